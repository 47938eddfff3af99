"""Build the shipped base models of `opsd demo`: opsd/demo/bases/seedN.safetensors and their SHA-256.

    python scripts/build_demo_bases.py               # seeds 0 1 2: train, write, print hashes and accuracies
    python scripts/build_demo_bases.py --check       # train and compare with the shipped files; write nothing
    python scripts/build_demo_bases.py --seeds 0 --out /tmp/bases

Each base is ``DemoSettings(seed=N)``'s, trained by ``opsd.demo.base.train_base_model`` (its own
loop, float32) on one torch thread, then stored as float16 safetensors: loaded back into float32 the
weights are exactly the stored values, and the accuracies printed here are those of the stored file.
The bytes are deterministic on one CPU with one torch build: a rebuild on the machine that built them
writes the same file (``--check`` says so). Another CPU's float32 kernels round differently, the SFT
amplifies that, and it writes another base: the reason the bases are shipped rather than built. After
writing, paste the printed ``SHIPPED`` dict into opsd/demo/base.py and the printed accuracies and CPU
into docs/demo.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

from opsd.demo import task
from opsd.demo.base import (
    BASE_KEYS,
    RECIPE_VERSION,
    SHIPPED,
    SHIPPED_DTYPE,
    DemoSettings,
    shipped_path,
    train_base_model,
)
from opsd.demo.run import demo_accuracy

SEEDS = (0, 1, 2)  # the demo's (0) and `opsd demo --compare --seeds 0,1,2`'s


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_base(seed: int, path: Path, progress: bool) -> str:
    """Train seed's base, store it at ``path``; returns the file's SHA-256."""
    from safetensors.torch import save_file

    s = DemoSettings(seed=seed)
    _, model, _ = train_base_model(s, progress=progress)
    tensors = {k: v.detach().to(SHIPPED_DTYPE).contiguous() for k, v in model.state_dict().items()}
    # one metadata key: the header stays byte-for-byte the same from run to run
    recipe = {"recipe_version": RECIPE_VERSION, **{k: getattr(s, k) for k in BASE_KEYS}}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"opsd_demo_base": json.dumps(recipe, sort_keys=True)})
    return hashlib.sha256(path.read_bytes()).hexdigest()


def accuracies(seed: int, path: Path) -> tuple[float, float]:
    """Held-out accuracy of the stored file: the student (problem only) and the teacher (with solution)."""
    from safetensors.torch import load_file

    from opsd.demo.base import build_tokenizer
    from opsd.tiny import build_tiny_model

    s = DemoSettings(seed=seed)
    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=s.hidden, num_layers=s.layers, seed=seed)
    model.load_state_dict({k: v.float() for k, v in load_file(str(path)).items()}, strict=True)
    held = task.make_splits(seed, s.digits, s.n_sft, s.n_train, s.n_heldout)["heldout"]
    return tuple(demo_accuracy(model, tok, held, s.digits, with_solution=w) for w in (False, True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=list(SEEDS))
    ap.add_argument("--check", action="store_true", help="compare with the shipped files, write nothing")
    ap.add_argument("--out", type=Path, default=None, help="directory to write to (default: the package's)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the demo's setting; also what makes the bytes reproducible
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, kernels {torch.backends.cpu.get_cpu_capability()}")
    hashes, mismatched = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            if args.check:
                path = Path(tmp) / f"seed{seed}.safetensors"
            elif args.out:
                path = args.out / f"seed{seed}.safetensors"
            else:
                path = shipped_path(seed)
            hashes[seed] = write_base(seed, path, progress=not args.no_progress)
            student, teacher = accuracies(seed, path)
            line = f"seed {seed}: {path} sha256 {hashes[seed]}; held-out student {100 * student:.1f}%, "
            line += f"teacher {100 * teacher:.1f}%"
            if args.check:
                same = SHIPPED.get(seed) == hashes[seed]
                mismatched += [] if same else [seed]
                line += "; matches the shipped file" if same else "; DIFFERS from the shipped file"
            print(line, flush=True)
    if args.check:
        return 1 if mismatched else 0
    print("SHIPPED: dict[int, str] = {")
    print("".join(f'    {seed}: "{h}",\n' for seed, h in hashes.items()) + "}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
