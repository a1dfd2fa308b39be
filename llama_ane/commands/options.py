"""Options shared by the commands: types for numbers that must be finite (and in range) and text
that must be UTF-8, the click options built from the export option table, the sampling options
of `generate` and `chat`, and the type and --revision option of an argument that may name a
Hugging Face repo.

A value that fails here is refused while click parses the command line, before any model is
loaded, with one `Error:` line that names the flag and exit code 1 (as every bad value the commands
check themselves).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import click

if TYPE_CHECKING:
    from ..contract.options import Option


class OptionError(click.ClickException):
    """A command-line value that cannot be used; the message names the flag."""


def flag_of(param: click.Parameter | None) -> str:
    """How the user wrote the parameter: its longest flag (`--top-p`), or an argument's name."""
    if param is None:
        return "the value"
    if isinstance(param, click.Option) and param.opts:
        return max(param.opts, key=len)
    return (param.name or "the value").upper()


class FiniteFloat(click.ParamType):
    """A float that is not nan or infinite, optionally within [minimum, maximum] (`*_open`: the bound
    itself excluded). Python's float() reads "nan", "inf" and "1e400" as numbers; sampling or sizing
    with them gives garbage or hangs far from where they were typed."""

    name = "number"

    def __init__(self, minimum: float | None = None, maximum: float | None = None, min_open: bool = False,
                 max_open: bool = False, unit: str = ""):
        self.minimum, self.maximum = minimum, maximum
        self.min_open, self.max_open = min_open, max_open
        self.unit = unit

    def _number(self, kind: str = "") -> str:
        """"a finite number of GiB"-style phrase."""
        return f"a {kind + ' ' if kind else ''}number" + (f" of {self.unit}" if self.unit else "")

    def _range(self) -> str:
        """The allowed range in words, e.g. "in (0, 1]", "a positive number of GB/s", "at least 0"."""
        low = None if self.minimum is None else ("(" if self.min_open else "[") + f"{self.minimum:g}"
        high = None if self.maximum is None else f"{self.maximum:g}" + (")" if self.max_open else "]")
        if low is not None and high is not None:
            return f"in {low}, {high}"
        unit = f" {self.unit}" if self.unit else ""
        if low is not None:
            if self.minimum == 0 and self.min_open:
                return self._number("positive")
            return f"{'greater than' if self.min_open else 'at least'} {self.minimum:g}{unit}"
        return f"{'less than' if self.max_open else 'at most'} {self.maximum:g}{unit}"

    def _in_range(self, x: float) -> bool:
        if self.minimum is not None and (x <= self.minimum if self.min_open else x < self.minimum):
            return False
        if self.maximum is not None and (x >= self.maximum if self.max_open else x > self.maximum):
            return False
        return True

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        flag = flag_of(param)
        try:
            x = float(value)
        except (TypeError, ValueError):
            raise OptionError(f"{flag} must be {self._number()}, got {value!r}") from None
        if not math.isfinite(x):
            raise OptionError(f"{flag} must be {self._number('finite')}, got {value!r}")
        if not self._in_range(x):
            raise OptionError(f"{flag} must be {self._range()}, got {value}")
        return x


class AtLeast(click.ParamType):
    """An integer of at least `minimum`, refused (as FiniteFloat refuses) with one line naming the flag."""

    name = "integer"

    def __init__(self, minimum: int):
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            n = int(value)
        except (TypeError, ValueError):
            raise OptionError(f"{flag_of(param)} must be an integer, got {value!r}") from None
        if n < self.minimum:
            raise OptionError(f"{flag_of(param)} must be at least {self.minimum}, got {n}")
        return n


TEMPERATURE = FiniteFloat(minimum=0)
TOP_P = FiniteFloat(minimum=0, maximum=1, min_open=True)
MIN_P = FiniteFloat(minimum=0, maximum=1)
REPETITION_PENALTY = FiniteFloat(minimum=0, min_open=True)

Decorator = Callable[[Callable], Callable]


def _stack(options: Iterable[Decorator]) -> Decorator:
    """One decorator applying `options` so that --help lists them in the order given."""
    options = list(options)

    def decorate(f: Callable) -> Callable:
        for add in reversed(options):
            f = add(f)
        return f
    return decorate


def click_type(opt: "Option") -> Any:
    """The click type of an export option (see contract.options.Option)."""
    if opt.choices:
        return click.Choice(opt.choices)
    if opt.type is float:
        return FiniteFloat(minimum=opt.minimum, min_open=opt.min_open, unit=opt.unit)
    if opt.type is Path:
        return click.Path(path_type=Path)
    return opt.type


def options_from(table: Iterable["Option"]) -> Decorator:
    """The click options of `table` (contract.options.EXPORT_OPTIONS): each option's flag, type,
    default, help and metavar, its parameter named as the API's keyword."""
    return _stack(click.option(opt.flag, opt.name, type=click_type(opt), default=opt.default, show_default=True,
                               metavar=opt.metavar, help=opt.help or None) for opt in table)


def sampling_options(max_new_tokens: int) -> Decorator:
    """The sampling options of `generate` and `chat` (what `/set` in chat changes, checked by these
    same click types): --max-new-tokens (its default the command's), --temperature, --top-k,
    --top-p, --min-p, --repetition-penalty, --seed and --stop."""
    return _stack([
        click.option("--max-new-tokens", type=AtLeast(1), default=max_new_tokens, show_default=True,
                     help="Longest reply, in tokens."),
        click.option("--temperature", type=TEMPERATURE, default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off."),
        click.option("--top-p", type=TOP_P, default=1.0, show_default=True),
        click.option("--min-p", type=MIN_P, default=0.0, show_default=True,
                     help="Keep tokens at least this fraction as likely as the most likely one (after top-p; "
                          "0 = off)."),
        click.option("--repetition-penalty", type=REPETITION_PENALTY, default=1.0, show_default=True,
                     help="Lower the logits of the last 64 context tokens: divided by it if positive, multiplied "
                          "if negative (1 = off)."),
        click.option("--seed", type=int, default=None),
        click.option("--stop", type=TEXT, multiple=True, help="End a reply at this string (repeatable)."),
    ])


def literal_constant(module: str, name: str) -> Any:
    """The value of the module-level constant `name` of `module` when its source assigns it a literal
    (a tuple of strings, ...), read without importing the module (None if it is not a literal)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return None
    return None


class LazyChoice(click.Choice):
    """A choice among the values of a constant (`BACKENDS`, `TARGETS`) that lives in a module the
    command only needs once it runs. A literal constant is read from the module's source, so --help
    and a check of a typed value answer without importing it (and torch with it); any other is
    imported then. A default is never checked, nor is anything read for another option's error."""

    def __init__(self, module: str, name: str):
        self._where = (module, name)
        self._choices: tuple[str, ...] | None = None
        super().__init__((), case_sensitive=True)

    @property
    def choices(self) -> tuple[str, ...]:
        if self._choices is None:
            value = literal_constant(*self._where)
            if value is None:
                import importlib

                value = getattr(importlib.import_module(self._where[0]), self._where[1])
            self._choices = tuple(value)
        return self._choices

    @choices.setter
    def choices(self, value) -> None:  # click.Choice's __init__ assigns its (empty) argument
        pass

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if param is not None and value == param.default:
            return value
        return super().convert(value, param, ctx)


BACKEND = LazyChoice("llama_ane.runtime.model", "BACKENDS")


class PathOrRepo(click.Path):
    """A local path (checked as click.Path checks it: `exists`, `file_okay`, ...) or a Hugging Face
    repo id (`owner/name` that names nothing here, see llama_ane.hub.repo_id), kept as typed: the
    command turns it into the folder it reads with llama_ane.hub.locate."""

    def __init__(self, **checks: Any) -> None:
        super().__init__(path_type=str, **checks)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from ..hub import repo_id

        if isinstance(value, str) and repo_id(value) is not None:
            return value
        return super().convert(value, param, ctx)


def revision_option(argument: str) -> Decorator:
    """--revision: the branch, tag or commit of ARGUMENT (a PathOrRepo) when it is a repo id."""
    return click.option("--revision", default=None, metavar="REV",
                        help=f"Branch, tag or commit of {argument} when it is a Hugging Face repo id.")


def not_utf8(where: str, data: bytes | str) -> str | None:
    """The refusal of `data` that is not UTF-8 text (bytes, or a str whose undecodable bytes Python
    kept as surrogates, as it does with command-line arguments and file names on Linux), naming the
    first bad byte and its offset; None if it is UTF-8."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
            return None
        except UnicodeEncodeError as e:
            start = e.start
        # the offset in the bytes the user gave: what precedes the bad character, encoded back
        prefix = data[:start].encode("utf-8", "surrogateescape")
        char = ord(data[start])
        byte = char - 0xDC00 if 0xDC80 <= char <= 0xDCFF else None
        if byte is None:  # a surrogate that stands for no byte (e.g. from "\ud800" in Python code)
            return f"{where} is not UTF-8 text (a lone surrogate U+{char:04X} at offset {len(prefix)})"
        return f"{where} is not UTF-8 text (byte 0x{byte:02x} at offset {len(prefix)})"
    try:
        data.decode("utf-8")
        return None
    except UnicodeDecodeError as e:
        return f"{where} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"


def read_utf8(path: str | Path, where: str) -> str:
    """The text of the file at `path`, which must be UTF-8; `where` names it in the refusal
    (e.g. "--prompt-file doc.txt")."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise OptionError(f"{where}: cannot read it ({e.strerror or e})") from None
    problem = not_utf8(where, data)
    if problem is not None:
        raise OptionError(f"{problem}; convert it to UTF-8 (e.g. iconv -t UTF-8)")
    return data.decode("utf-8")


class Utf8Text(click.ParamType):
    """A text option whose bytes must be UTF-8 (click passes on what the OS decoded, bad bytes and all)."""

    name = "text"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        problem = not_utf8(flag_of(param), value) if isinstance(value, str) else None
        if problem is not None:
            raise OptionError(f"{problem}; pass UTF-8 text")
        return value


class Utf8File(click.Path):
    """An existing file that must hold UTF-8 text; converts to its Path (the command reads it).
    With `stdin`, "-" stands for standard input (converted to the string "-": see `read_text_arg`)."""

    def __init__(self, stdin: bool = False) -> None:
        super().__init__(exists=True, dir_okay=False, readable=True, path_type=Path, allow_dash=stdin)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path | str:
        if value == "-" and self.allow_dash:
            return "-"
        path = super().convert(value, param, ctx)
        read_utf8(path, f"{flag_of(param)} {path}")
        return path


def read_text_arg(value: Path | str, flag: str) -> str:
    """The text of a Utf8File option's value: the file's, or standard input's for "-"."""
    if value != "-":
        return Path(value).read_text(encoding="utf-8")
    data = click.get_binary_stream("stdin").read()
    problem = not_utf8(f"{flag} - (standard input)", data)
    if problem is not None:
        raise OptionError(f"{problem}; convert it to UTF-8 (e.g. iconv -t UTF-8)")
    return data.decode("utf-8")


TEXT = Utf8Text()
