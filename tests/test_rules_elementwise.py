import numpy as np
import pytest
import torch

from harness import check_op

rng = np.random.default_rng(0)


def r(*shape):
    return np.asarray(rng.standard_normal(shape))


BROADCAST = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 4)), ((), (2, 3)), ((2, 1, 4), (3, 1))]


@pytest.mark.parametrize("sa,sb", BROADCAST)
@pytest.mark.parametrize("op,fn", [("Add", torch.add), ("Sub", torch.sub), ("Mul", torch.mul)])
def test_binary_broadcast(op, fn, sa, sb):
    check_op(op, [("a", r(*sa)), ("b", r(*sb))], fn)


@pytest.mark.parametrize("sa,sb", BROADCAST)
def test_div(sa, sb):
    b = r(*sb)
    b = np.where(np.abs(b) < 0.3, 0.7, b)
    check_op("Div", [("a", r(*sa)), ("b", b)], torch.div)


def test_neg_identity():
    check_op("Neg", [("x", r(3, 4))], torch.neg)
    check_op("Identity", [("x", r(3, 4))], lambda x: x * 1)
