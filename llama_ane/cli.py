"""The `llama-ane` command line: a click group whose commands live in `llama_ane.commands.*`.

Each command module is imported only when its command runs, and the command list of
`llama-ane --help` is read from the modules' source (each command's docstring) without importing
them, so `--help` and a mistyped option answer at once, without torch, coremltools or transformers.
A command's own --help imports its module, which imports only what its options need (choices
that live in heavy modules are read from their source: options.LazyChoice), and ends with the
command's EXAMPLES.
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


# what each command's --help ends with: a few command lines to copy (out/smollm2 is where `make run` exports)
EXAMPLES = {
    "export": [
        "llama-ane export -o out/smollm2  # the embedded SmolLM2-135M-Instruct",
        "llama-ane export HuggingFaceTB/SmolLM2-360M-Instruct -o out/smollm2-360m --quantize lut6",
        "llama-ane export path/to/model.gguf -o out/model --context-length 2048 --verify-window 16",
    ],
    "generate": [
        'llama-ane generate out/smollm2 --prompt "Name three rivers." --max-new-tokens 48',
        'llama-ane generate default --prompt "Hi"  # the embedded model, unexported (torch)',
        'llama-ane generate out/smollm2 --prompt-file doc.txt --question "Who?" --question "When?"',
        'llama-ane generate out/smollm2 --prompt "Once upon a time" --raw --temperature 0.8 --seed 1',
    ],
    "chat": [
        'llama-ane chat out/smollm2 --system "You are terse."',
        "llama-ane chat out/smollm2 --prompt-cache chat.npz  # resume the conversation saved there",
    ],
    "info": [
        "llama-ane info out/smollm2",
        'llama-ane info out/smollm2 --chip "M4 Max" --prompt-length 512 --branches 8',
        "llama-ane info --config path/to/config.json --context-length 4096 --quantize lut4 --json",
    ],
    "inspect": [
        "llama-ane inspect out/smollm2 --strict",
        "llama-ane inspect out/smollm2/chunk_0.mlpackage --json",
    ],
    "eval": [
        "llama-ane eval out/smollm2",
        "llama-ane eval out/smollm2-lut4 --reference out/smollm2 --text notes.txt",
    ],
    "verify": [
        "llama-ane verify out/smollm2",
        "llama-ane verify out/smollm2 --backend mil --precision fp16 --ane-numerics",
    ],
    "serve": [
        "llama-ane serve out/smollm2  # http://127.0.0.1:8080/v1",
        "llama-ane serve out/smollm2 --port 9000 --api-key KEY --prompt-cache-dir caches/",
    ],
    "bench": [
        "llama-ane bench out/smollm2",
        "llama-ane bench out/smollm2 --prompt-lengths 128,512 --filled 0,500 --json bench.json",
    ],
    "gpu-generate": [
        "llama-ane gpu-generate  # SmolLM2, on an NVIDIA GPU",
        'llama-ane gpu-generate path/to/llama --branch "Q1" --branch "Q2" --check',
    ],
}


def examples_epilog(name: str) -> str | None:
    """The Examples section of a command's --help, comments aligned (click keeps the lines after \\b)."""
    rows = [line.split("  # ", 1) for line in EXAMPLES.get(name, ())]
    if not rows:
        return None
    width = max((len(row[0]) for row in rows if len(row) == 2), default=0)
    lines = [f"  {row[0]:<{width}}  # {row[1]}" if len(row) == 2 else f"  {row[0]}" for row in rows]
    return "\b\nExamples:\n" + "\n".join(lines)


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
        command = importlib.import_module(f"llama_ane.commands.{module}").command
        if command.epilog is None:
            command.epilog = examples_epilog(name)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(len(name) for name in COMMANDS)
        rows = [(name, click.Command(name, help=command_docstring(COMMANDS[name])).get_short_help_str(limit))
                for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(self, args=None, *rest, **kwargs):
        from ._quiet import quiet_third_party

        # before any command module can import coremltools; -v (an option of the group, so before
        # the command's name) keeps its messages
        argv = list(sys.argv[1:] if args is None else args)
        group_options = argv[:next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))]
        quiet_third_party(not {"-v", "--verbose"} & set(group_options))
        return super().main(argv, *rest, **kwargs)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="llama-ane")
@click.option("-v", "--verbose", is_flag=True,
              help="Show the third-party messages hidden by default (coremltools' import messages, the Core AI "
                   "packages' progress and version warnings).")
def main(verbose: bool) -> None:
    """Export Llama checkpoints to chunked Core ML programs for the Apple Neural Engine, and run them."""


if __name__ == "__main__":
    main()
