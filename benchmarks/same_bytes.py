"""Are this tree's Core ML exports the bytes an earlier commit writes?

Exports one tiny random Llama checkpoint (llama_ane.testing, seed 0), or the checkpoint folder
`--checkpoint` names, with the Core ML target, once with this tree and once with COMMIT (a git
worktree in a temporary folder), and compares every
file of the two export folders by SHA-256. manifest.json is compared with its source path and
tool-version fields left out, since those name the run rather than the program.

    python benchmarks/same_bytes.py --against 08947d9
    python benchmarks/same_bytes.py --against d811f95~1 --options "--kv-cache state"
    python benchmarks/same_bytes.py --against HEAD~1 --checkpoint /tmp/tiny-qwen35   # any checkpoint folder

Exits 0 when every package file is the same, 1 otherwise (naming the files that differ).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_FIELDS = ("path", "name", "version", "llama_ane_version", "coremltools_version", "created")


def export(tree: Path, ckpt: Path, out: Path, options: list[str]) -> None:
    cmd = [sys.executable, "-m", "llama_ane", "export", str(ckpt), "-o", str(out), "--no-verify", *options]
    r = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    if r.returncode:
        raise SystemExit(f"export with {tree} failed:\n{r.stderr[-2000:]}")


def _strip(value):
    """A manifest without the fields that name the run (source path, versions, dates)."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in RUN_FIELDS and not k.endswith("_version")}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def digests(out: Path) -> dict[str, str]:
    found = {}
    for p in sorted(out.rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        if p.name == "manifest.json" and p.parent == out:
            manifest = _strip(json.loads(data))
            manifest.pop("checksums", None)  # they hash the packages compared one by one here
            data = json.dumps(manifest, sort_keys=True).encode()
        found[str(p.relative_to(out))] = hashlib.sha256(data).hexdigest()
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, help="the earlier commit")
    ap.add_argument("--options", default="", help="more export options, e.g. \"--kv-cache state\"")
    ap.add_argument("--checkpoint", type=Path, help="a checkpoint folder to export (default: a tiny random Llama)")
    args = ap.parse_args()
    options = shlex.split(args.options)
    with tempfile.TemporaryDirectory(prefix="llama-ane-same-bytes-") as tmp:
        tmp = Path(tmp)
        worktree = tmp / "then"
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(worktree), args.against],
                       cwd=ROOT, check=True, capture_output=True)
        try:
            sys.path.insert(0, str(ROOT))
            from llama_ane.testing import make_tiny_checkpoint

            ckpt = args.checkpoint.resolve() if args.checkpoint else make_tiny_checkpoint(tmp / "tiny", seed=0)
            export(worktree, ckpt, tmp / "then_out", options)
            export(ROOT, ckpt, tmp / "now_out", options)
            then, now = digests(tmp / "then_out"), digests(tmp / "now_out")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
    differ = sorted(k for k in then.keys() & now.keys() if then[k] != now[k])
    only = sorted(then.keys() ^ now.keys())
    same = len(then.keys() & now.keys()) - len(differ)
    source = args.checkpoint or "tiny Llama"
    print(f"{source}, Core ML{' ' + args.options if options else ''}: {same} files the same, "
          f"{len(differ)} differ, {len(only)} in one export only (against {args.against})")
    for name in differ + only:
        print("  " + name)
    return 1 if differ or only else 0


if __name__ == "__main__":
    sys.exit(main())
