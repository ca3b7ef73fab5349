"""Copy configs/serve.yaml verbatim into k8s/rayservice.yaml's serveConfigV2 (tests/test_k8s.py checks they match).

Run from anywhere:  python scripts/sync_k8s.py [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "serve.yaml"
MANIFEST = ROOT / "k8s" / "rayservice.yaml"
KEY = "  serveConfigV2: |"
INDENT = "    "


def render(manifest: str, config: str) -> str:
    """Replace the block scalar under `serveConfigV2: |` by `config`, indented."""
    lines = manifest.splitlines()
    start = lines.index(KEY) + 1
    end = start
    while end < len(lines) and (lines[end].startswith(INDENT) or not lines[end].strip()):
        end += 1
    block = [INDENT + l if l.strip() else "" for l in config.rstrip("\n").splitlines()]
    return "\n".join(lines[:start] + block + lines[end:]) + "\n"


def main() -> int:
    want = render(MANIFEST.read_text(), CONFIG.read_text())
    if "--check" in sys.argv:
        if want != MANIFEST.read_text():
            print(f"{MANIFEST} is out of date with {CONFIG}: run python scripts/sync_k8s.py", file=sys.stderr)
            return 1
        return 0
    MANIFEST.write_text(want)
    print(f"wrote serveConfigV2 of {MANIFEST.relative_to(ROOT)} from {CONFIG.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
