"""Render chat templates exactly as transformers does, within a budget per row and without its per-call overhead."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jinja2 import BaseLoader, TemplateError, nodes
from jinja2.filters import make_attrgetter
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dpo_data.errors import DataError
from dpo_data.prepare.inputs import MAX_ROW_BYTES
from dpo_data.prepare.rows import RowReject
from dpo_data.tokenizer.chat import alias_reasoning, chat_environment, template_data
from dpo_state.digest import bytes_digest

_PLAIN_KEYS = frozenset(("role", "content"))
RENDER_SECONDS = 1.0
"""CPU time all the renderings of one row may take. Real chat templates render a row in microseconds."""
MAX_INT_BITS = 1 << 16
"""The largest number a template may compute (65536 bits): far past any count or id, well short of a slow one."""
MEMORY_PER_CHAR = 64
"""Bytes of address space a rendering may add per character of its budget (Linux): room for its strings."""
_CLOCK_EVERY = 16  # ticks between two reads of the CPU clock (a read is a system call)
_SIZED = (str, bytes, list, tuple, dict, set, frozenset)
TEMPLATE_FAILURES = ("template_error", "template_budget")
"""Reject reasons of a row the chat template could not render."""
FAIL_FAST_ROWS = 8
"""With --chat-template, this many rows failing in the template before one renders stop the build."""


def render_chars(max_row_bytes: int) -> int:
    """The most characters one rendering (or a value inside it) may hold: a rendering holds a row's text about
    once plus the template's own, so twice the largest row --max-row-bytes lets in, plus 1 Mi."""
    return 2 * max_row_bytes + (1 << 20)


def unrenderable(template: Any, what: str, first: str, where: str = "") -> DataError:
    """A --chat-template that renders none of the rows that reach it cannot render the data: an error, not rejects."""
    at = f", the first at {where}" if where else ""
    return DataError(
        f"--chat-template {template} cannot render the data: {what}{at} ({first}); fix the template so that it "
        "renders these conversations (docs/data-build.md)"
    )


class OverBudget(Exception):
    """A rendering past its budget; the message says which and by how much."""


class _Budget:
    """What the renderings of one row may spend: CPU time (a deadline), characters per value and per rendering."""

    def __init__(self, chars: int, seconds: float = RENDER_SECONDS):
        self.chars, self.seconds = chars, seconds
        self.deadline = math.inf
        self._ticks = 0

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        """The budget of everything inside (nested, the outer one's): a deadline, and the address-space cap. Only
        renderings belong inside: the cap would also bind the Rust tokenizer, which aborts where Python raises."""
        if self.deadline != math.inf:
            yield
            return
        self.deadline = time.thread_time() + self.seconds
        try:
            with _address_space_cap(MEMORY_PER_CHAR * self.chars):
                yield
        finally:
            self.deadline = math.inf

    def tick(self) -> None:
        """Called by every call, filter and loop iteration: a template cannot run long without passing here (its
        straight-line code is as long as its text)."""
        self._ticks += 1
        if self._ticks % _CLOCK_EVERY == 0 and time.thread_time() > self.deadline:
            raise OverBudget(f"it took over {self.seconds:g} s of CPU time, where chat templates take microseconds")

    def iterate(self, iterable: Any) -> Iterator[Any]:
        """What every `{% for %}` iterates: a loop with an empty body still ticks the clock."""
        for item in iterable:
            self.tick()
            yield item

    def check(self, value: Any) -> Any:
        """`value`, unless it holds more characters or items than a whole rendering may."""
        if isinstance(value, _SIZED) and len(value) > self.chars:
            raise OverBudget(f"it made a value of {len(value)} characters or items, over the {self.chars} allowed")
        return value

    def operands(self, operator: str, left: Any, right: Any) -> None:
        """Refuse `left operator right` before it is computed when its result would be over budget."""
        self.tick()
        size, bits = _result_size(operator, left, right)
        if size > self.chars:
            raise OverBudget(
                f"{type(left).__name__} {operator} {type(right).__name__} would make a value of {size} characters "
                f"or items, over the {self.chars} allowed"
            )
        if bits > MAX_INT_BITS:
            raise OverBudget(f"{operator} would make a number of {bits} bits, over the {MAX_INT_BITS} allowed")


def _result_size(operator: str, left: Any, right: Any) -> tuple[int, int]:
    """(characters or items, bits of a number) that `left operator right` would hold, found without computing it."""
    ints = _is_int(left) and _is_int(right)
    if operator == "*" and ints:
        return 0, left.bit_length() + right.bit_length()
    if operator == "*":
        count, sequence = (left, right) if _is_int(left) else (right, left)
        return (len(sequence) * max(count, 0) if _is_int(count) and isinstance(sequence, _SIZED) else 0), 0
    if operator == "**" and ints and abs(left) > 1 and right > 0:
        return 0, left.bit_length() * right
    return 0, 0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _SelfContained(BaseLoader):
    """The loader of a chat template: nothing to load. (Without one, an include is a TypeError; this names why.)"""

    def get_source(self, environment: Any, template: str) -> Any:
        raise TemplateError(
            f"the chat template includes, imports or extends {template!r}, but chat templates must be "
            "self-contained (no loader is configured); put that template's text in the chat template itself"
        )


_ITERATE = "budgeted iteration"  # the filter every loop's iterable goes through (a name no template can write)


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox with a budget: every call, filter, loop iteration and operator that can grow a value
    ticks the row's clock, and what they make (and what a namespace stores) is checked for size.

    Attribute and item reads are not hooked (they are most of a template's work): they only read what was
    made, and the one place a template keeps what it made across loop iterations is a namespace."""

    # `+` is left alone (templates use it everywhere): what it grows is checked where it is stored or passed on.
    # Intercepted operators are also never folded at compile time, where nothing is budgeted.
    intercepted_binops = frozenset(("*", "**", "%"))
    budget: _Budget

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        __self.budget.tick()
        for value in (*args, *kwargs.values()):  # a macro that recurses on a value it doubles
            __self.budget.check(value)
        return __self.budget.check(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.budget.operands(operator, left, right)
        return self.budget.check(super().call_binop(context, operator, left, right))

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        # Loops are the one construct that can run long without a hook (range() is at most 100000 long, but
        # loops nest): each loop's iterable goes through the budget's iteration, called directly as a filter is.
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, _ITERATE, [], [], None, None, lineno=loop.iter.lineno)
        return tree.set_environment(self)


def _budgeted_environment(budget: _Budget) -> _BudgetedEnvironment:
    """The environment transformers compiles chat templates in (its options, globals, filters and extensions, as
    dpo_data/tokenizer/chat.py builds it), with the budget's hooks and no loader."""
    env = chat_environment(_BudgetedEnvironment)
    env.globals["namespace"] = _budgeted_namespace(budget, env.globals["namespace"])
    env.filters = {name: _budgeted_filter(budget, f) for name, f in env.filters.items()}
    env.filters["sum"] = _budgeted_sum(budget, env.filters["sum"])
    env.filters[_ITERATE] = budget.iterate
    env.loader = _SelfContained()
    env.optimized = False  # nothing evaluated at compile time beyond what output folding does
    env.budget = budget
    return env


def _budgeted_sum(budget: _Budget, builtin: Any) -> Any:
    """`sum` with a list or tuple `start` adds sequences, which takes time quadratic in their number inside one
    builtin call, past any clock: that case adds them one by one (the same result), the others are the builtin's."""

    @functools.wraps(builtin)
    def budgeted(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
        if not isinstance(start, (list, tuple)):
            return builtin(environment, iterable, attribute, start)
        total = start
        items = iterable if attribute is None else map(make_attrgetter(environment, attribute), iterable)
        for item in items:
            budget.tick()
            total = budget.check(total + item)
        return total

    return budgeted


def _budgeted_namespace(budget: _Budget, namespace: type) -> type:
    """transformers' namespace, whose attributes may hold no more than a rendering may."""

    class BudgetedNamespace(namespace):
        def __setitem__(self, name: str, value: Any) -> None:
            super().__setitem__(name, budget.check(value))

    return BudgetedNamespace


def _budgeted_filter(budget: _Budget, f: Any) -> Any:
    """Filters are called directly by compiled code, not through `call`: the same tick and size check."""

    @functools.wraps(f)  # keeps jinja_pass_arg, so the filter still gets its context
    def budgeted(*args: Any, **kwargs: Any) -> Any:
        budget.tick()
        return budget.check(f(*args, **kwargs))

    return budgeted


class ChatRenderer:
    """`render(messages, add_generation_prompt, tools)` == `tokenizer.apply_chat_template(..., tokenize=False)`,
    within a budget, or a `RowReject` (`template_error`, `template_budget`).

    transformers spends most of a call normalizing and copying the conversation (for objects, media,
    reasoning aliases and None values). Messages that are plain `{"role": str, "content": str}` dicts
    need none of it, so for them the template is rendered directly with the variables transformers passes
    (messages, tools, documents, add_generation_prompt, the special-token map). Anything else (tool calls,
    other message keys, a `tools` list) goes through the tokenizer's `apply_chat_template` itself (transformers',
    or the light tokenizer's, which renders by the same rules), after the same rendering under the budget (so the
    work it then does is known to fit). tests/data/test_template.py and test_light_tokenizer.py pin the equality.
    The environment is transformers' as dpo_data/tokenizer/chat.py builds it, so rendering imports no
    transformers.

    The budget of a row (`row()`, or one rendering alone): `RENDER_SECONDS` of CPU time in all, `chars`
    characters for the output of one rendering and for any value made inside it, numbers of at most
    `MAX_INT_BITS` bits, and, on Linux, `MEMORY_PER_CHAR` x `chars` bytes more address space than the process
    had (an allocation past that is a MemoryError, whatever builtin makes it). A constant expression, which
    transformers' compiler computes whether or not it is reached, is computed once under the same budget.
    """

    def __init__(self, tokenizer: Any, chars: int = render_chars(MAX_ROW_BYTES)):
        self.tokenizer = tokenizer
        self._budget = _Budget(chars)
        self._env = _budgeted_environment(self._budget)
        self._variables = dict(tokenizer.special_tokens_map)
        self._templates: dict[str, Any] = {}
        if isinstance(tokenizer.chat_template, str):  # now, in a budget of its own rather than the first row's
            self._compile(tokenizer.chat_template)

    def row(self) -> contextlib.AbstractContextManager:
        """One budget for every rendering inside: a row's (nested, a no-op). Encode outside it."""
        return self._budget.window()

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        with self.row():
            try:
                return self._render(messages, add_generation_prompt, tools)
            except Exception as e:  # noqa: BLE001 - the template is the user's code: whatever it raises is its failure
                raise _as_reject(e) from None

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str:
        text = self.tokenizer.chat_template
        template = self._compiled(text if isinstance(text, str) else self.tokenizer.get_chat_template(None, tools))
        plain = tools is None and all(m.keys() == _PLAIN_KEYS for m in messages)
        inputs, schemas = (messages, tools) if plain else _as_transformers_passes(messages, tools)
        variables = {**self._variables, "tools": schemas, "documents": None}
        rendered = self._stream(template, messages=inputs, add_generation_prompt=add_generation_prompt, **variables)
        if plain:
            return rendered
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _stream(self, template: Any, **variables: Any) -> str:
        """The rendering, piece by piece, stopped once it passes the budget (`render` would join it all first)."""
        pieces, size, chars = [], 0, self._budget.chars
        stream = template.generate(**variables)
        try:
            for piece in stream:
                size += len(piece)
                if size > chars:
                    raise OverBudget(f"its rendering passed {chars} characters")
                pieces.append(piece)
        finally:
            stream.close()
        return "".join(pieces)

    def _compile(self, text: str) -> None:
        """Compile `text` in the budgeted environment, its constants checked; a failure is kept as the reject of
        every row."""
        try:
            with self.row():
                self._templates[text] = _compile_checked(self._env, text)
        except Exception as e:  # noqa: BLE001 - as in render: a template that cannot compile fails every row
            reject = _as_reject(e)
            self._templates[text] = (reject.reason, reject.message)

    def _compiled(self, text: str) -> Any:
        """The template `text` compiled (once per text), or its reject."""
        if text not in self._templates:
            self._compile(text)
        found = self._templates[text]
        if isinstance(found, tuple):
            raise RowReject(*found)  # a new exception each row: a stored one would grow its traceback
        return found


def _compile_checked(env: _BudgetedEnvironment, text: str) -> Any:
    """`text` compiled in `env` (a TemplateSyntaxError if it does not parse), after computing each constant
    expression under the budget: transformers' compiler folds them whether or not they are ever reached (so
    `{% if false %}{{ 'x' * 10**10 }}{% endif %}` asks it for 10 GB), and its sandbox does not intercept that."""
    tree = env.parse(text)
    for expression in _constant_expressions(tree):
        alone = nodes.Template([nodes.Output([expression], lineno=expression.lineno)], lineno=expression.lineno)
        try:
            code = env.compile(alone.set_environment(env))
            env.template_class.from_code(env, code, env.make_globals(None), None).render()
        except (OverBudget, MemoryError, RecursionError) as e:
            raise OverBudget(f"line {expression.lineno}: a constant expression is over budget ({_reason(e)})") from None
        except Exception:  # noqa: BLE001 - transformers' compiler leaves a failing constant to run time
            continue
    return env.from_string(tree)


_FOLDABLE = (
    nodes.Literal,
    nodes.Helper,
    nodes.BinExpr,
    nodes.UnaryExpr,
    nodes.CondExpr,
    nodes.Filter,
    nodes.Test,
    nodes.Getitem,
    nodes.Getattr,
    nodes.Slice,
    nodes.Concat,
    nodes.Compare,
)


def _foldable(node: nodes.Node) -> bool:
    """Whether a compiler could compute `node` from the template's text alone (no variable, call or block)."""
    if not isinstance(node, _FOLDABLE) or (isinstance(node, nodes.Filter) and node.node is None):
        return False
    return all(_foldable(child) for child in node.iter_child_nodes())


def _constant_expressions(node: nodes.Node) -> Iterator[nodes.Expr]:
    """The largest computed constant expressions under `node` (literals alone compute nothing)."""
    for child in node.iter_child_nodes():
        whole = isinstance(child, nodes.Expr) and not isinstance(child, (nodes.Slice, nodes.Const, nodes.TemplateData))
        if whole and _foldable(child):
            yield child
        else:
            yield from _constant_expressions(child)


def _as_transformers_passes(messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """Messages and tools as `apply_chat_template` hands them to the template (None values dropped, plain data,
    reasoning under its aliases), so the budgeted rendering does the work transformers' own will do."""
    return alias_reasoning(template_data([{k: v for k, v in m.items() if v is not None} for m in messages])), (
        template_data(tools)
    )


def _as_reject(e: BaseException) -> RowReject:
    """The row's reject for what a template raised: over budget (time, size, memory, depth) or any other failure."""
    if isinstance(e, RowReject):
        return e
    if isinstance(e, (OverBudget, MemoryError, RecursionError)):
        return RowReject("template_budget", f"the chat template is over its budget on this row: {_reason(e)}")
    detail = str(e) if isinstance(e, TemplateError) else f"{type(e).__name__}: {e}"
    return RowReject("template_error", f"the chat template failed on this conversation: {detail}")


def _reason(e: BaseException) -> str:
    if isinstance(e, MemoryError):
        return "it needed more memory than a rendering may take"
    if isinstance(e, RecursionError):
        return "it recursed too deep (a macro that calls itself without end?)"
    return str(e)


@contextlib.contextmanager
def _address_space_cap(margin: int) -> Iterator[None]:
    """Lower the soft address-space limit to what the process maps now plus `margin`, and restore it: an allocation
    past it fails as a MemoryError inside the rendering instead of taking the machine's memory."""
    restore = _lower_address_space(margin)
    try:
        yield
    finally:
        if restore is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, restore)


def _lower_address_space(margin: int) -> tuple[int, int] | None:
    """Set the soft RLIMIT_AS to the mapped size (VmSize) plus `margin`; the limits to restore, or None where
    nothing was set (not Linux: no /proc/self/statm, or no RLIMIT_AS)."""
    try:
        import resource

        fd = os.open("/proc/self/statm", os.O_RDONLY)
        try:
            mapped = int(os.read(fd, 64).split()[0]) * os.sysconf("SC_PAGE_SIZE")
        finally:
            os.close(fd)
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = min(limit for limit in (mapped + margin, soft, hard) if limit != resource.RLIM_INFINITY)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (ImportError, OSError, ValueError, AttributeError):
        return None
    return soft, hard


def read_chat_template(path: str | Path, chars: int = render_chars(MAX_ROW_BYTES)) -> dict:
    """`--chat-template FILE` as the manifest records it: `{"file": name, "sha256": "sha256:<hex>", "text": ...}`.

    A file that cannot be read, is not UTF-8, is blank, does not compile as a Jinja template (in transformers'
    environment), includes, imports or extends another template, or holds a constant expression over the
    rendering budget (`chars` characters) is a DataError naming the file and the fix."""
    path = Path(path)
    fix = "pass a chat template file (Jinja text, as in a tokenizer's chat_template.jinja)"
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"--chat-template {path}: cannot read it ({e.strerror or e}); {fix}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--chat-template {path}: not UTF-8 text (byte {e.start}); {fix}") from None
    if not text.strip():
        raise DataError(f"--chat-template {path}: the file is empty; {fix}")
    _check_template(path, text, fix, chars)
    return {"file": path.name, "sha256": bytes_digest(data), "text": text}


def _check_template(path: Path, text: str, fix: str, chars: int) -> None:
    """A DataError unless `text` compiles, is self-contained and its constant expressions fit the budget."""
    budget = _Budget(chars)
    env = _budgeted_environment(budget)
    try:
        tree = env.parse(text)
        loads = next(tree.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)), None)
        if loads is not None:
            raise DataError(
                f"--chat-template {path}: line {loads.lineno} {_load_verb(loads)} another template, but a chat "
                "template must be self-contained (no loader is configured): put that template's text in this file"
            )
        with budget.window():
            _compile_checked(env, text)
    except TemplateError as e:
        line = f" line {e.lineno}" if getattr(e, "lineno", None) else ""
        raise DataError(f"--chat-template {path}: not a valid Jinja template ({e.message}{line}); {fix}") from None
    except (OverBudget, MemoryError, RecursionError) as e:
        raise DataError(
            f"--chat-template {path}: {_reason(e)}; see the rendering budget in docs/data-build.md and fix the template"
        ) from None


def _load_verb(node: nodes.Node) -> str:
    return {nodes.Include: "includes", nodes.Extends: "extends"}.get(type(node), "imports")
