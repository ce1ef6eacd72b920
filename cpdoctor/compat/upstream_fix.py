"""The fix to hand upstream: a minimal unified diff against the installed diffusers' own
`attention_dispatch.py`, for the defects of diffusers' ring that cpdoctor knows.

cpdoctor's own ring (cpdoctor/fix/) is a different design (streamed K/V); a maintainer needs the smallest change
to *their* code. So each fix here finds its place in the installed source by the code's structure (the class, the
method, the statement, matched on the AST: never a line number, never a release number), edits only those
statements, and refuses with a one-line reason when the structure is not the one the fix knows. The diff is made
with difflib, with the paths of diffusers' repository (`a/src/diffusers/...`), so `patch -p1` applies it in a
checkout of the release it was made from.

The fixes:
- dK/dV direction: at ring step i rank r holds KV chunk (r + i) mod W, so the dK/dV accumulator belongs at rank
  r − 1; the ring's backward sends it to r + 1 (`next_ranks = list(range(1, W)) + [0]`), right only at W = 2.
  The fix sends it the other way (`[W - 1] + list(range(W - 1))`); the final hop that returns each chunk's
  gradient to its owner uses the same permutation and is then right too.
- mask not rotated: the ring hands every rotated KV chunk the local rank's key mask. The fix gathers the ranks'
  masks once (as Ulysses does) and gives each step the mask of the chunk it holds, in forward and, through
  `ctx.attn_mask` (which the backends' backward ops read), in backward.
- stale K/V (a ring backward that calls `backward_op(ctx, grad_out)`): not fixable in the ring alone, since every
  backend's backward op recomputes from what its forward saved at step 0; refused with that reason.
- double transpose (a backend backward op that transposes the saved K/V again although its forward saved them in
  kernel layout): the two transposes are dropped.
- saved tensors unpacked per ring step (the ring backward calls the backend's backward op once per step, and every
  op unpacks `ctx.saved_tensors`; torch's non-reentrant activation checkpointing allows one unpack): the ring
  backward unpacks them once and hands the op, instead of the autograd ctx, a view of it whose `saved_tensors` is
  that tuple (every other attribute read and written through to the ctx). The forward ops and the backward ops
  stay as they are, so every backend's op contract is kept.
"""

from __future__ import annotations

import ast
import difflib
import enum
import inspect
import os
import re
from dataclasses import dataclass

RING_CLASS = "TemplatedRingAttention"
DOUBLE_TRANSPOSE_OPS = ("_native_flash_attention_backward_op", "_cudnn_attention_backward_op")
"""The backward ops whose forward saves K/V in kernel layout (B, H, S, D): transposing them again is the defect."""


class UpstreamDefect(enum.Enum):
    """A defect in diffusers' own code that cpdoctor can write an upstream fix for (or say why it cannot); the
    values name them for people (examinations/attention/upstream.py maps each to the judge's rule that finds it)."""

    DKV_DIRECTION = "dK/dV direction"
    MASK_NOT_ROTATED = "mask not rotated"
    STALE_KV = "stale K/V"
    DOUBLE_TRANSPOSE = "double transpose"
    SAVED_PER_STEP = "saved tensors unpacked per ring step"


class FixRefused(Exception):
    """The installed source is not the structure a fix knows (or the defect has no minimal fix): one line why."""


@dataclass(frozen=True)
class SourceFile:
    """One file of the installed diffusers: where it is on disk, its path in diffusers' repository, its text."""

    path: str
    repo_path: str
    text: str


@dataclass(frozen=True)
class UpstreamFix:
    """A diff for some defects of one file: the text before and after, and the unified diff between them."""

    defects: tuple[UpstreamDefect, ...]
    source: SourceFile
    patched: str
    diff: str


def dispatch_source() -> SourceFile:
    """The installed `diffusers/models/attention_dispatch.py`, found with `inspect.getsourcefile`."""
    from diffusers.models import attention_dispatch

    path = inspect.getsourcefile(attention_dispatch)
    if path is None:
        raise FixRefused("the installed diffusers has no Python source for attention_dispatch (compiled only)")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    return SourceFile(path, repo_path(path, package_folder()), text)


def package_folder() -> str:
    """The installed `diffusers` package folder (what a verification copies)."""
    import diffusers

    return os.path.dirname(os.path.abspath(inspect.getsourcefile(diffusers) or diffusers.__file__))


def repo_path(path: str, package: str) -> str:
    """A file's path in diffusers' repository: the package lives under `src/` there."""
    rel = os.path.relpath(os.path.abspath(path), os.path.dirname(package))
    return "src/" + rel.replace(os.sep, "/")


# -- finding the structure ---------------------------------------------------------------------------------


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise FixRefused(f"attention_dispatch.py has no class {name}")


def _function(body: list[ast.stmt], name: str, where: str) -> ast.FunctionDef:
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise FixRefused(f"{where} has no function {name}")


def _ring_loop(fn: ast.FunctionDef, where: str) -> tuple[ast.For, str, str]:
    """The ring's `for <i> in range(<world_size>):` among the method's statements: the loop, i, world_size."""
    for node in fn.body:
        if (
            isinstance(node, ast.For)
            and isinstance(node.target, ast.Name)
            and isinstance(node.iter, ast.Call)
            and isinstance(node.iter.func, ast.Name)
            and node.iter.func.id == "range"
            and len(node.iter.args) == 1
            and isinstance(node.iter.args[0], ast.Name)
        ):
            return node, node.target.id, node.iter.args[0].id
    raise FixRefused(f"{where} has no ring loop `for i in range(world_size)`")


def _assigned_from_attribute(fn: ast.FunctionDef, attr: str, where: str) -> str:
    """The name a method assigns from `<...>.<attr>` (e.g. the ring rank from `._ring_local_rank`)."""
    for node in fn.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == attr
        ):
            return node.targets[0].id
    raise FixRefused(f"{where} does not read its ring rank from `{attr}`")


def _calls(node: ast.AST, callee: str) -> bool:
    """Does this statement call `<callee>(...)` or `<x>.<callee>(...)`?"""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            if (isinstance(func, ast.Name) and func.id == callee) or (isinstance(func, ast.Attribute) and func.attr == callee):
                return True
    return False


def _statement_calling(loop: ast.For, callee: str, where: str) -> ast.stmt:
    """The statement of the ring loop's body that calls the op `callee` (forward_op / backward_op)."""
    for node in loop.body:
        if _calls(node, callee):
            return node
    raise FixRefused(f"the ring loop of {where} does not call {callee}")


def _gather_call(fn: ast.FunctionDef, where: str) -> tuple[str, str]:
    """The K/V all-gather of a ring method (`<funcol>.all_gather_tensor(..., group=<group>)`): the module it is
    called on and the group expression, so the mask is gathered the same way over the same group."""
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "all_gather_tensor"
            and isinstance(node.func.value, ast.Name)
        ):
            group = next((k.value for k in node.keywords if k.arg == "group"), None)
            if group is not None:
                return node.func.value.id, ast.unparse(group)
    raise FixRefused(f"{where} does not all-gather K/V with `all_gather_tensor(..., group=...)`")


def _mentions(fn: ast.FunctionDef, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(fn))


# -- editing -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Edit:
    """Replace lines [start, end) (0-based) of the file with `lines` (each without its newline)."""

    start: int
    end: int
    lines: tuple[str, ...]


def _indent_of(lines: list[str], node: ast.stmt) -> str:
    line = lines[node.lineno - 1]
    return line[: len(line) - len(line.lstrip())]


def _insert_before(lines: list[str], node: ast.stmt, block: list[str]) -> _Edit:
    indent = _indent_of(lines, node)
    return _Edit(node.lineno - 1, node.lineno - 1, tuple(indent + b if b else b for b in block))


def _apply(text: str, edits: list[_Edit]) -> str:
    lines = text.split("\n")
    for edit in sorted(edits, key=lambda e: (e.start, e.end), reverse=True):
        lines[edit.start : edit.end] = list(edit.lines)
    return "\n".join(lines)


# -- the fixes ---------------------------------------------------------------------------------------------

_SENDS_TO_NEXT = "list(range(1, {w})) + [0]"
MASK_MESSAGE = (
    "Ring attention supports only a key-only attn_mask of shape (batch, 1 or heads, 1, local keys), ",
    "rotated with its keys; got {tuple(attn_mask.shape)} with {key.shape[1]} local keys.",
)
"""What the patched ring says when it refuses a mask it cannot rotate (two string lines in the patched code, the
second an f-string: the mask's shape and the local key count are filled in there)."""


def _direction_edits(tree: ast.Module, lines: list[str]) -> list[_Edit]:
    """Send the ring backward's dK/dV accumulator to rank r − 1: rewrite the `next_ranks = list(range(1, W)) +
    [0]` that feeds its `permute_tensor` calls."""
    where = f"{RING_CLASS}.backward"
    fn = _function(_class(tree, RING_CLASS).body, "backward", RING_CLASS)
    permuted = {
        a.id
        for n in ast.walk(fn)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "permute_tensor"
        for a in n.args[1:2]
        if isinstance(a, ast.Name)
    }
    if not permuted:
        raise FixRefused(f"{where} does not send its dK/dV accumulator with permute_tensor(buffer, ranks, ...)")
    loop, _, _ = _ring_loop(fn, where)
    if not any(_calls(node, "permute_tensor") for node in fn.body[fn.body.index(loop) + 1 :]):
        raise FixRefused(
            f"{where} has no final hop after its ring loop: sending the accumulator the other way alone would not "
            "return each chunk's gradient to its owner"
        )
    for node in fn.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        target = node.targets[0].id
        value = node.value
        if target not in permuted or not (isinstance(value, ast.BinOp) and isinstance(value.left, ast.Call)):
            continue
        inner = value.left.args[0] if value.left.args else None
        world = inner.args[-1] if isinstance(inner, ast.Call) and inner.args else None
        if not isinstance(world, ast.Name):
            continue
        if ast.dump(value) != ast.dump(ast.parse(_SENDS_TO_NEXT.format(w=world.id), mode="eval").body):
            continue
        if node.lineno != node.end_lineno:
            raise FixRefused(f"{where}: `{target} = ...` spans several lines; the fix rewrites one statement line")
        w = world.id
        indent = _indent_of(lines, node)
        return [
            _Edit(
                node.lineno - 1,
                node.lineno,
                (
                    f"{indent}# At ring step i rank r holds KV chunk (r + i) % {w}, so the dK/dV accumulator goes to rank r - 1.",
                    f"{indent}{target} = [{w} - 1] + list(range({w} - 1))",
                ),
            )
        ]
    raise FixRefused(f"{where} does not send its dK/dV accumulator to rank r+1 (`list(range(1, W)) + [0]`): the structure differs")


def _mask_edits(tree: ast.Module, lines: list[str]) -> list[_Edit]:
    """Rotate the key mask with its keys: gather the ranks' masks before the forward's ring loop, give each step
    the mask of the chunk it holds in forward, and the same in backward through `ctx.attn_mask`."""
    cls = _class(tree, RING_CLASS)
    edits: list[_Edit] = []
    forward = _function(cls.body, "forward", RING_CLASS)
    backward = _function(cls.body, "backward", RING_CLASS)
    fwhere, bwhere = f"{RING_CLASS}.forward", f"{RING_CLASS}.backward"
    if not _mentions(forward, "attn_mask"):
        raise FixRefused(f"{fwhere} has no `attn_mask` to rotate")
    if _mentions(forward, "attn_masks") or _mentions(backward, "attn_masks"):
        raise FixRefused(f"{RING_CLASS} already names `attn_masks`: the mask fix would collide with it")
    if any(isinstance(n, ast.Call) and _calls(n, "all_gather_tensor") and "mask" in ast.unparse(n) for n in ast.walk(forward)):
        raise FixRefused(f"{fwhere} already gathers the mask")
    if "key" not in {a.arg for a in forward.args.args}:
        raise FixRefused(f"{fwhere} takes no `key`: the mask's shape cannot be checked against the local keys")
    funcol, group = _gather_call(forward, fwhere)
    loop, i, world = _ring_loop(forward, fwhere)
    rank = _assigned_from_attribute(forward, "_ring_local_rank", fwhere)
    edits.append(
        _insert_before(
            lines,
            loop,
            [
                "# Each KV chunk has its own key mask: gather the ranks' masks once and rotate them with the keys.",
                "attn_masks = None",
                "if attn_mask is not None:",
                "    if attn_mask.ndim != 4 or attn_mask.shape[-2] != 1 or attn_mask.shape[-1] != key.shape[1]:",
                "        # Rank r's mask row holds only its own keys; a mask over query positions would need the",
                "        # rows of the other ranks' queries too, which no rank holds.",
                "        raise ValueError(",
                *(f'            {"f" if "{" in part else ""}"{part}"' for part in MASK_MESSAGE),
                "        )",
                f"    attn_masks = {funcol}.all_gather_tensor(attn_mask.contiguous(), gather_dim=0, group={group})",
                f"    attn_masks = attn_masks.chunk({world})",
                "ctx.ring_attn_masks = attn_masks",
                "",
            ],
        )
    )
    call = _statement_calling(loop, "forward_op", fwhere)
    edits.append(_insert_before(lines, call, ["if attn_masks is not None:", f"    attn_mask = attn_masks[({rank} + {i}) % {world}]", ""]))
    bloop, bi, bworld = _ring_loop(backward, bwhere)
    brank = _assigned_from_attribute(backward, "_ring_local_rank", bwhere)
    bcall = _statement_calling(bloop, "backward_op", bwhere)
    edits.append(
        _insert_before(
            lines,
            bcall,
            [
                "if ctx.ring_attn_masks is not None:",
                "    # The backend's backward op reads the mask its forward op saved: give it this chunk's.",
                f"    ctx.attn_mask = ctx.ring_attn_masks[({brank} + {bi}) % {bworld}]",
                "",
            ],
        )
    )
    return edits


STALE_KV_FIXED_IN = "diffusers 0.40.0"
"""The release whose ring backward first hands the backend's op the rotated K/V and the global out/lse
(diffusers #14265 / PR #14274, docs/FACTS.md "Upstream status"): named in the refusal, never compared with."""


def _stale_kv_edits(tree: ast.Module, lines: list[str]) -> list[_Edit]:
    raise FixRefused(
        "the stale K/V has no minimal fix in the ring: every backend's backward op recomputes from what its forward "
        f"saved at step 0 and takes no rotated K/V, out or lse; {STALE_KV_FIXED_IN} changed that op contract and "
        f"fixed it: upgrade to {STALE_KV_FIXED_IN} or later, then re-check ring ≥ 3"
    )


def _double_transpose_edits(tree: ast.Module, lines: list[str]) -> list[_Edit]:
    """Drop `key = key.transpose(1, 2)...` and `value = value.transpose(1, 2)...` from the backward ops whose
    K/V come from `ctx.saved_tensors` in kernel layout while their query is used as saved."""
    edits: list[_Edit] = []
    for name in DOUBLE_TRANSPOSE_OPS:
        fn = _function(tree.body, name, "attention_dispatch.py")
        unpacks_saved = any(
            isinstance(n, ast.Assign) and isinstance(n.value, ast.Attribute) and n.value.attr == "saved_tensors" for n in fn.body
        )
        if not unpacks_saved:
            raise FixRefused(f"{name} does not unpack its K/V from ctx.saved_tensors")
        again = {}
        for node in fn.body:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in ("query", "key", "value")
                and re.fullmatch(rf"{node.targets[0].id}\.transpose\(1, 2\)(\.contiguous\(\))?", ast.unparse(node.value))
            ):
                again[node.targets[0].id] = node
        if "query" in again or set(again) != {"key", "value"}:
            raise FixRefused(f"{name} does not transpose exactly its saved key and value again: the structure differs")
        edits += [_Edit(node.lineno - 1, node.end_lineno or node.lineno, ()) for node in again.values()]
    return edits


RING_CTX_CLASS = "_RingBackwardCtx"
RING_CTX_SOURCE = '''class _RingBackwardCtx:
    """What the ring backward hands the backend's backward op at each ring step: the autograd ctx, except that
    `saved_tensors` is what the ring unpacked once. Under torch's non-reentrant activation checkpointing
    (`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, which `enable_gradient_checkpointing()` uses)
    a saved tensor can be unpacked only once, and the ops unpack `ctx.saved_tensors` every time they are called."""

    def __init__(self, ctx, saved_tensors):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "saved_tensors", saved_tensors)

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)
'''
"""The class the fix adds before the ring's class (module level, so the ops see an ordinary object)."""


def _reads_saved(node: ast.AST, ctx_name: str) -> list[ast.Attribute]:
    """The `<ctx>.saved_tensors` reads in a statement."""
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and n.attr == "saved_tensors" and isinstance(n.value, ast.Name) and n.value.id == ctx_name
    ]


def _replace_spans(lines: list[str], spans: list[tuple[int, int, int]], text: str) -> list[_Edit]:
    """Replace each (line, start col, end col) span (0-based line; one line each) with `text`, one edit per line."""
    by_line: dict[int, list[tuple[int, int]]] = {}
    for line, start, end in spans:
        by_line.setdefault(line, []).append((start, end))
    edits = []
    for line, cols in by_line.items():
        new = lines[line]
        for start, end in sorted(cols, reverse=True):
            new = new[:start] + text + new[end:]
        edits.append(_Edit(line, line + 1, (new,)))
    return edits


def _saved_once_edits(tree: ast.Module, lines: list[str]) -> list[_Edit]:
    """Unpack ctx.saved_tensors once in the ring backward and hand the backend's op a ctx view that returns them:
    add the view's class before the ring's class, unpack once before the first read (or before the ring loop),
    read that tuple where the backward read the ctx's, and pass the view as the op's first argument."""
    where = f"{RING_CLASS}.backward"
    if any(isinstance(n, ast.ClassDef) and n.name == RING_CTX_CLASS for n in tree.body):
        raise FixRefused(f"attention_dispatch.py already has a class {RING_CTX_CLASS}")
    cls = _class(tree, RING_CLASS)
    fn = _function(cls.body, "backward", RING_CLASS)
    if not fn.args.args:
        raise FixRefused(f"{where} takes no ctx")
    ctx_name = fn.args.args[0].arg
    if _mentions(fn, "saved_tensors") or _mentions(fn, "op_ctx"):
        raise FixRefused(f"{where} already names `saved_tensors` or `op_ctx`: the fix would collide with them")
    loop, _, _ = _ring_loop(fn, where)
    call = next(
        n
        for n in ast.walk(_statement_calling(loop, "backward_op", where))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward_op"
    )
    first = call.args[0] if call.args else None
    if not (isinstance(first, ast.Name) and first.id == ctx_name):
        raise FixRefused(f"{where} does not hand its backend's backward op the autograd ctx as its first argument")
    if _reads_saved(loop, ctx_name):
        raise FixRefused(f"the ring loop of {where} reads {ctx_name}.saved_tensors itself: unpacking once needs another shape")
    before = fn.body[: fn.body.index(loop)]
    readers = [node for node in before if _reads_saved(node, ctx_name)]
    spans = [(a.lineno - 1, a.col_offset, a.end_col_offset or a.col_offset) for r in readers for a in _reads_saved(r, ctx_name)]
    if any(a.lineno != a.end_lineno for r in readers for a in _reads_saved(r, ctx_name)):
        raise FixRefused(f"{where} reads {ctx_name}.saved_tensors across lines")
    edits = [
        _insert_before(lines, cls, [*RING_CTX_SOURCE.rstrip("\n").split("\n"), "", ""]),
        _insert_before(
            lines,
            readers[0] if readers else loop,
            [
                "# Non-reentrant activation checkpointing allows one unpack of each saved tensor, and the backend's",
                "# backward op unpacks ctx.saved_tensors at every ring step: unpack them once and hand the op a view.",
                f"saved_tensors = {ctx_name}.saved_tensors",
                f"op_ctx = {RING_CTX_CLASS}({ctx_name}, saved_tensors)",
            ]
            + ([] if readers else [""]),
        ),
    ]
    edits += _replace_spans(lines, spans, "saved_tensors")
    edits += _replace_spans(lines, [(first.lineno - 1, first.col_offset, first.end_col_offset or first.col_offset)], "op_ctx")
    return edits


_EDITORS = {
    UpstreamDefect.DKV_DIRECTION: _direction_edits,
    UpstreamDefect.MASK_NOT_ROTATED: _mask_edits,
    UpstreamDefect.STALE_KV: _stale_kv_edits,
    UpstreamDefect.DOUBLE_TRANSPOSE: _double_transpose_edits,
    UpstreamDefect.SAVED_PER_STEP: _saved_once_edits,
}


def _recomputes_stale(tree: ast.Module) -> bool:
    """Does the ring backward call its backend op without the rotated chunk (`backward_op(ctx, grad_out)`)?"""
    fn = _function(_class(tree, RING_CLASS).body, "backward", RING_CLASS)
    loop, _, _ = _ring_loop(fn, f"{RING_CLASS}.backward")
    for node in ast.walk(_statement_calling(loop, "backward_op", f"{RING_CLASS}.backward")):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward_op":
            return not any(k.arg == "key" for k in node.keywords)
    return False


def present(source: SourceFile, defect: UpstreamDefect) -> bool:
    """Does the installed source show the structure of this defect (for a fixable one: its fix would apply)?"""
    try:
        tree = ast.parse(source.text)
        if defect is UpstreamDefect.STALE_KV:
            return _recomputes_stale(tree)
        _EDITORS[defect](tree, source.text.split("\n"))
    except (FixRefused, SyntaxError):
        return False
    return True


def make_fix(source: SourceFile, defects: tuple[UpstreamDefect, ...]) -> UpstreamFix:
    """The unified diff fixing `defects` in `source`, or FixRefused (the first defect whose structure differs)."""
    if not defects:
        raise FixRefused("no defect cpdoctor knows how to fix upstream")
    try:
        tree = ast.parse(source.text)
    except SyntaxError as exc:
        raise FixRefused(f"{source.repo_path} does not parse ({exc.msg})") from exc
    lines = source.text.split("\n")
    edits = [edit for defect in defects for edit in _EDITORS[defect](tree, lines)]
    patched = _apply(source.text, edits)
    ast.parse(patched)  # the fix must leave valid Python (a SyntaxError here is cpdoctor's bug, not the user's)
    diff = "".join(
        difflib.unified_diff(
            source.text.splitlines(keepends=True),
            patched.splitlines(keepends=True),
            fromfile=f"a/{source.repo_path}",
            tofile=f"b/{source.repo_path}",
        )
    )
    return UpstreamFix(tuple(defects), source, patched, diff)


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def apply_diff(text: str, diff: str) -> str:
    """Apply a unified diff of one file to `text` exactly (every context and removed line must match where the
    hunk says); ValueError when it does not apply. What a verification applies to its copy of the package."""
    old = text.splitlines(keepends=True)
    new: list[str] = []
    pos = 0
    lines = diff.splitlines(keepends=True)
    n = 0
    while n < len(lines) and not lines[n].startswith("@@"):
        n += 1
    while n < len(lines):
        match = _HUNK.match(lines[n])
        if match is None:
            raise ValueError(f"not a hunk header: {lines[n].rstrip()}")
        start = int(match.group(1)) - (0 if match.group(2) == "0" else 1)
        new += old[pos:start]
        pos = start
        n += 1
        while n < len(lines) and not lines[n].startswith("@@"):
            tag, body = lines[n][:1], lines[n][1:]
            if tag in (" ", "-"):
                if pos >= len(old) or old[pos] != body:
                    raise ValueError(f"the diff does not apply at line {pos + 1}")
                pos += 1
                if tag == " ":
                    new.append(body)
            elif tag == "+":
                new.append(body)
            elif tag != "\\":
                raise ValueError(f"unexpected diff line: {lines[n].rstrip()}")
            n += 1
    return "".join(new + old[pos:])
