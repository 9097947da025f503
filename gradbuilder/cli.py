"""The `gradbuilder` command: parse, call the library, report; turn every failure into a message and an exit code.

Exit codes: 0 success, 2 bad input or usage (a GradBuilderError: the message says what to change),
1 a bug in gradbuilder (any other exception: a short message, "please report", `--debug` for the traceback).
Outputs are written atomically, so a failed run leaves nothing behind and never touches the input.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import onnx

from .builder import build_gradient_graph
from .draw import DEFAULT_MAX_NODES, render_svg, to_dot
from .errors import GradBuilderError
from .graph import FLOAT_TYPES, UMASK, entry, external_data_files, save_model_atomic, save_text_atomic
from .inspect_model import (
    gradient_table,
    inspect_model,
    node_counts,
    op_table,
    plural,
    render_gradients,
    render_json,
    render_ops_markdown,
    render_ops_text,
    render_text,
)
from .split import split

PROG = "gradbuilder"
SPLIT_FILES = ("forward.onnx", "backward.onnx", "manifest.json")


class CliError(GradBuilderError):
    """A problem with a path or option given on the command line (not with the model itself)."""


def version() -> str:
    try:
        from importlib.metadata import version as dist_version

        return dist_version("gradbuilder")
    except Exception:  # running from a source tree that was never installed
        return "unknown"


# --------------------------------------------------------------------------------------------------
# paths


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _check_writable(out: Path, what: str) -> None:
    """Fail before the work, not after it: the nearest existing ancestor must be a writable directory."""
    parent = out.parent
    while not parent.exists():
        if parent == parent.parent:
            break
        parent = parent.parent
    if not parent.is_dir():
        raise CliError(f"cannot write {what} {out}: {parent} is a file, not a directory.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CliError(f"cannot write {what} {out}: directory {parent} is not writable.")


def _check_keeps_input_data(out: Path, inp: Path) -> None:
    """The input's external data files are part of the input: the output must neither be one (a build written
    over it loads as the input's weights, silently wrong) nor a directory holding one (split replaces it)."""
    if not out.exists() or not inp.is_file():
        return
    target, base = entry(out), inp.parent.resolve()  # data files are read beside the path given, a link or not
    if not (target.is_relative_to(base) or base.is_relative_to(target)):
        return  # data files lie under the model's directory: no need to read the model
    for data in sorted(external_data_files(inp)):
        if data.is_relative_to(target):
            raise CliError(f"output {out} {'is' if data == target else 'holds'} the external data file {data.name} of "
                           f"the input {inp}, which holds the input's weights; gradbuilder never overwrites its "
                           "input. Give another output path.")


def _check_output_file(out: Path, inp: Path, kind: str = ".onnx") -> None:
    if out.is_dir():
        raise CliError(f"output {out} is a directory; give the path of the {kind} file to write.")
    if _same_file(out, inp):
        raise CliError(f"output {out} is the input file; gradbuilder never overwrites its input. "
                       "Give another output path.")
    _check_keeps_input_data(out, inp)
    _check_writable(out, "output")


def _check_output_dir(out: Path, inp: Path) -> None:
    """DIR may be new, empty, or an earlier split's output (then it is replaced as a whole)."""
    if out.exists() and not out.is_dir():
        raise CliError(f"output {out} exists and is not a directory; give a directory for {', '.join(SPLIT_FILES)}.")
    if inp.resolve().is_relative_to(out.resolve()):
        raise CliError(f"the input {inp} lies inside the output directory {out}, which split replaces as a whole; "
                       "give another output directory.")
    _check_keeps_input_data(out, inp)
    if out.is_dir():
        others = sorted(p.name for p in out.iterdir() if p.name not in SPLIT_FILES
                        and p.name.removesuffix(".data") not in SPLIT_FILES)
        if others:
            shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            raise CliError(f"output directory {out} already holds other files ({shown}); split replaces the "
                           "directory as a whole, so give a new or empty one, or the directory of an earlier split.")
    _check_writable(out, "output directory")


def _write_dir_atomic(out: Path, write: Callable[[Path], None]) -> None:
    """Let `write` fill a temp dir beside `out`, then move it into place; on any failure nothing is left."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    old: Path | None = None
    try:
        write(tmp)
        os.chmod(tmp, 0o777 & ~UMASK)  # mkdtemp makes it 0700
        if out.exists():  # an earlier split (checked): swap it out, then delete it
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / out.name)
        try:
            os.replace(tmp, out)
        except BaseException:
            if old is not None:
                os.replace(old / out.name, out)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not (old / out.name).exists():
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_error(what: str, path: Path, e: OSError) -> CliError:
    return CliError(f"cannot write {what} {path}: {e.strerror or e}.")


# --------------------------------------------------------------------------------------------------
# commands


def _say(args: argparse.Namespace, text: str) -> None:
    if not args.quiet and text:
        print(text)


def cmd_build(args: argparse.Namespace) -> int:
    inp, out = Path(args.input), Path(args.output)
    _check_output_file(out, inp)
    training = build_gradient_graph(inp, wrt=args.wrt, outputs=args.outputs, loss=args.loss,
                                    freeze=args.freeze or ())
    try:
        save_model_atomic(training, out)
    except OSError as e:
        raise _write_error("output", out, e) from e
    fwd, bwd = node_counts(training)
    rows = gradient_table(training)
    _say(args, render_gradients(rows) if rows else _nothing_differentiated(training))
    _say(args, f"wrote {out}: {fwd} forward nodes, {bwd} backward nodes")
    return 0


def _nothing_differentiated(training: onnx.ModelProto) -> str:
    """Why a build lists no parameter: the model has no float initializer (the default --wrt), as when an exporter
    wrote its weights as Constant nodes, which are then named."""
    consts = [n.output[0] for n in training.graph.node if n.op_type == "Constant" and n.domain in ("", "ai.onnx")
              and any(a.name in ("value_float", "value_floats") or a.t.data_type in FLOAT_TYPES for a in n.attribute)]
    held = (f"; {plural(len(consts), 'Constant node')} {'holds' if len(consts) == 1 else 'hold'} float values "
            f"({', '.join(consts[:5])}"
            f"{', ...' if len(consts) > 5 else ''}), perhaps its weights") if consts else ""
    return (f"note: nothing was differentiated: the model has no float initializer, which is what gets a gradient "
            f"unless --wrt names tensors{held}. Name the tensors to differentiate with --wrt.")


def cmd_split(args: argparse.Namespace) -> int:
    inp, out = Path(args.input), Path(args.output)
    _check_output_dir(out, inp)
    forward, backward, manifest = split(inp)

    def write(d: Path) -> None:
        save_model_atomic(forward, d / "forward.onnx")
        save_model_atomic(backward, d / "backward.onnx")
        save_text_atomic(manifest.to_json() + "\n", d / "manifest.json")

    try:
        _write_dir_atomic(out, write)
    except OSError as e:
        raise _write_error("output directory", out, e) from e
    _say(args, f"wrote {out}/: forward.onnx ({len(forward.graph.node)} nodes), backward.onnx "
               f"({len(backward.graph.node)} nodes), manifest.json ({plural(len(manifest.stashed), 'stashed tensor')})")
    if not manifest.backward_outputs:  # onnxruntime refuses a graph without outputs, with an obscure message
        _say(args, "note: no tensor gets a gradient (manifest.json's no_gradient says why, zero_gradient lists those "
                   "whose gradient is zeros), so backward.onnx computes "
                   "nothing and onnxruntime will not load it: run forward.onnx alone.")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    report = inspect_model(Path(args.input), dict(args.dim or ()))
    print(render_json(report) if args.json else render_text(report))
    return 0


DRAW_FORMATS = {".svg": "svg", ".dot": "dot", ".gv": "dot"}


def cmd_draw(args: argparse.Namespace) -> int:
    inp, out = Path(args.input), Path(args.output)
    fmt = DRAW_FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise CliError(f"cannot tell what to write to {out}: give OUT.svg for the picture, or OUT.dot (or .gv) "
                       "for its Graphviz source.")
    _check_output_file(out, inp, kind=out.suffix)
    picture = to_dot(inp, around=args.around or (), radius=args.radius, max_nodes=args.max_nodes)
    text = render_svg(picture.dot) if fmt == "svg" else picture.dot
    try:
        save_text_atomic(text, out)
    except OSError as e:
        raise _write_error("output", out, e) from e
    _say(args, "\n".join([f"wrote {out}: {picture.summary()}", *(f"note: {n}" for n in picture.notes)]))
    return 0


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = low - 1
        if n < low:
            raise argparse.ArgumentTypeError(f"expected an integer of at least {low}, got '{text}'")
        return n
    return parse


def cmd_ops(args: argparse.Namespace) -> int:
    rows = op_table()
    print(render_ops_markdown(rows) if args.markdown else render_ops_text(rows), end="" if args.markdown else "\n")
    return 0


# --------------------------------------------------------------------------------------------------
# parsing


def _dim(text: str) -> tuple[str, int]:
    name, sep, value = text.rpartition("=")  # the last '=': a symbolic dim's name may hold one (exporters keep any)
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not sep or not name or n < 0:
        raise argparse.ArgumentTypeError(f"expected NAME=N with N a non-negative integer, got '{text}'")
    return name, n


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # accepted before and after the command; SUPPRESS keeps a later absence from resetting an earlier -q (the
    # action objects are shared with every parser that lists `common` as a parent, so no set_defaults here)
    common.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="print nothing but errors (build, split, draw)")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the Python traceback of an error")
    p = argparse.ArgumentParser(prog=PROG, parents=[common],
                                description="Backward graphs for ONNX models, in standard ONNX ops.")
    p.add_argument("--version", action="version", version=f"{PROG} {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    b = sub.add_parser("build", parents=[common], help="forward model -> training graph",
                       description="Emit the training graph (forward, Yield, backward) of a forward ONNX model.")
    b.add_argument("input", metavar="IN.onnx")
    b.add_argument("-o", "--output", metavar="OUT.onnx", required=True)
    b.add_argument("--loss", metavar="NAME", help="scalar float output seeded with gradient 1 in the graph")
    b.add_argument("--wrt", metavar="NAME", nargs="+", action="extend",
                   help="tensors to differentiate (default: every float initializer)")
    b.add_argument("--freeze", metavar="NAME", nargs="+", action="extend", help="tensors that get no gradient")
    b.add_argument("--outputs", metavar="NAME", nargs="+", action="extend",
                   help="outputs whose gradient the host supplies (default: every float output, none with --loss)")
    b.set_defaults(run=cmd_build)

    s = sub.add_parser("split", parents=[common], help="training graph -> forward.onnx, backward.onnx, manifest.json",
                       description="Cut a training graph at its Yield node into two runnable models and a manifest.")
    s.add_argument("input", metavar="TRAINING.onnx")
    s.add_argument("-o", "--output", metavar="DIR", required=True)
    s.set_defaults(run=cmd_split)

    i = sub.add_parser("inspect", parents=[common], help="summarise a forward model or a training graph")
    i.add_argument("input", metavar="FILE.onnx")
    i.add_argument("--json", action="store_true", help="print the summary as JSON")
    i.add_argument("--dim", metavar="NAME=N", type=_dim, action="append",
                   help="value of a symbolic dim for byte counts, e.g. --dim batch=32")
    i.set_defaults(run=cmd_inspect)

    d = sub.add_parser("draw", parents=[common], help="picture of a training graph (or forward model) as SVG",
                       description="Draw a training graph: forward nodes, the Yield boundary and backward nodes in "
                       "three colours, stashed tensors as purple cylinders, parameters that get no gradient dashed. "
                       "SVG needs Graphviz: `pip install 'gradbuilder[draw]'` (no system package) or a `dot` program; "
                       "OUT.dot writes the Graphviz source without it.")
    d.add_argument("input", metavar="FILE.onnx")
    d.add_argument("-o", "--output", metavar="OUT.svg", required=True, help="OUT.svg, or OUT.dot for the DOT source")
    d.add_argument("--around", metavar="NAME", nargs="+", action="extend",
                   help="draw only the neighbourhood of these nodes or tensors (highlighted)")
    d.add_argument("--radius", metavar="N", type=_at_least(0),
                   help="steps out from --around (default 2) or from the Yield")
    d.add_argument("--max-nodes", metavar="N", type=_at_least(1), default=DEFAULT_MAX_NODES,
                   help=f"draw at most N nodes, nearest the Yield or --around first (default {DEFAULT_MAX_NODES})")
    d.set_defaults(run=cmd_draw)

    o = sub.add_parser("ops", parents=[common], help="list the ops that have gradient rules")
    o.add_argument("--markdown", action="store_true", help="print the table of docs/ops.md")
    o.set_defaults(run=cmd_ops)
    return p


# --------------------------------------------------------------------------------------------------
# entry point


def _error(text: str) -> None:
    print(f"{PROG}: error: {text}", file=sys.stderr)


def _report_bug(e: BaseException, argv: Sequence[str]) -> None:
    _error(f"internal error: {type(e).__name__}: {e}. This is a bug in gradbuilder, not a problem with your model "
           f"or command: please report it to the gradbuilder maintainers with the command line "
           f"({PROG} {' '.join(argv)}), the version ({version()}) and, if you can, the model. Run again with "
           "--debug for the traceback.")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # usage errors, --help, --version: argparse already printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    args.quiet = getattr(args, "quiet", False)
    args.debug = getattr(args, "debug", False)
    try:
        return int(args.run(args))
    except GradBuilderError as e:
        if args.debug:
            traceback.print_exc()
        _error(str(e))
        return e.exit_code
    except KeyboardInterrupt:
        _error("interrupted.")
        return 130
    except BrokenPipeError:  # `gradbuilder ops | head`: the reader left; not an error worth a message
        _silence_stdout()
        return 141
    except Exception as e:
        if args.debug:
            traceback.print_exc()
        _report_bug(e, argv)
        return 1


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
