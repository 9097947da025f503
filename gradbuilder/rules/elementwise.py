"""Elementwise arithmetic with numpy broadcasting: one small function per op."""

from __future__ import annotations

from .context import Grad
from .registry import rule


@rule("Identity", since=13)
def identity(g: Grad):
    return (g.GO(0),)


@rule("Add", since=13)
def add(g: Grad):
    dy = g.GO(0)
    return (g.unbroadcast(dy, like=g.I(0)) if g.needs(0) else None,
            g.unbroadcast(dy, like=g.I(1)) if g.needs(1) else None)


@rule("Sub", since=13)
def sub(g: Grad):
    dy = g.GO(0)
    return (g.unbroadcast(dy, like=g.I(0)) if g.needs(0) else None,
            g.unbroadcast(g.Neg(dy), like=g.I(1)) if g.needs(1) else None)


@rule("Mul", since=13)
def mul(g: Grad):
    a, b, dy = g.I(0), g.I(1), g.GO(0)
    return (g.unbroadcast(g.Mul(dy, b), like=a) if g.needs(0) else None,
            g.unbroadcast(g.Mul(dy, a), like=b) if g.needs(1) else None)


@rule("Div", since=13)
def div(g: Grad):
    a, b, y, dy = g.I(0), g.I(1), g.O(0), g.GO(0)
    da = g.Div(dy, b) if g.needs(0) else None
    # d(a/b)/db = -y/b: reads the output instead of squaring b
    db = g.unbroadcast(g.Neg(g.Mul(dy, g.Div(y, b))), like=b) if g.needs(1) else None
    return (g.unbroadcast(da, like=a) if da is not None else None, db)


@rule("Neg", since=13)
def neg(g: Grad):
    return (g.Neg(g.GO(0)),)
