"""The `llama-ane` command line: a click group whose commands live in `llama_ane.commands.*`.

Each command module is imported only when its command runs, so `llama-ane --help` stays fast and
`llama-ane gpu ...` works without coremltools.
"""

from __future__ import annotations

import importlib
import logging

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


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        module = COMMANDS.get(name)
        if module is None:
            return None
        return importlib.import_module(f"llama_ane.commands.{module}").command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="llama-ane")
@click.option("-v", "--verbose", is_flag=True, help="Show coremltools' own warnings.")
def main(verbose: bool) -> None:
    """Export Llama checkpoints to chunked Core ML programs for the Apple Neural Engine, and run them."""
    if not verbose:
        # coremltools warns at import that it cannot predict off macOS and about untested torch
        # versions; the commands say what matters themselves.
        logging.getLogger("coremltools").setLevel(logging.ERROR)


if __name__ == "__main__":
    main()
