"""The `llama-ane` command line: a click group whose commands live in `llama_ane.commands.*`.

Each command module is imported only when its command runs, and the command list of
`llama-ane --help` is read from the modules' source (each command's docstring) without importing
them, so `--help` and a mistyped option answer at once, without torch, coremltools or transformers.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys

import click

# command name -> module under llama_ane.commands defining a click command called `command`
COMMANDS = {
    "export": "export",
    "chat": "chat",
    "eval": "eval",
    "generate": "generate",
    "info": "info",
    "inspect": "inspect",
    "verify": "verify",
    "gpu-generate": "gpu_generate",
    "serve": "serve",
    "bench": "bench",
}


def command_docstring(module: str) -> str:
    """The docstring of `command` in llama_ane.commands.MODULE, read from its source (nothing is imported)."""
    spec = importlib.util.find_spec(f"llama_ane.commands.{module}")
    if spec is None or spec.origin is None:
        return ""
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "command":
            return ast.get_docstring(node) or ""
    return ""


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        module = COMMANDS.get(name)
        if module is None:
            return None
        return importlib.import_module(f"llama_ane.commands.{module}").command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(len(name) for name in COMMANDS)
        rows = [(name, click.Command(name, help=command_docstring(COMMANDS[name])).get_short_help_str(limit))
                for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(self, args=None, *rest, **kwargs):
        from ._quiet import quiet_coremltools

        # before any command module can import coremltools; -v (an option of the group, so before
        # the command's name) keeps its messages
        argv = list(sys.argv[1:] if args is None else args)
        group_options = argv[:next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))]
        quiet_coremltools(not {"-v", "--verbose"} & set(group_options))
        return super().main(argv, *rest, **kwargs)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="llama-ane")
@click.option("-v", "--verbose", is_flag=True, help="Show third-party warnings (coremltools' import messages).")
def main(verbose: bool) -> None:
    """Export Llama checkpoints to chunked Core ML programs for the Apple Neural Engine, and run them."""


if __name__ == "__main__":
    main()
