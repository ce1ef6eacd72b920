"""A folder from which torchtitan 0.3.0's FLUX trainer runs on CPU ranks as its users launch it
(`torchrun ... -m torchtitan.train --module torchtitan_recipes.tests.flux --config flux_debugmodel_test ...`), for
`cpdoctor step --emulate torchtitan-cpu -- <that command>` (docs/STEP_COMMAND.md, "torchtitan's trainer"):

- torchtitan's own test assets its test config reads relative to the working folder (`tests/assets/tokenizer`,
  `tests/assets/cc12m_test`), copied from a torchtitan source checkout (or a bare git directory of it): the wheel
  does not ship them;
- the T5 and CLIP encoder configs of this folder (`t5/`, `clip/`): torchtitan's test configs shrunk to one layer
  (its T5 test config is the full XXL, 4.7B parameters at random init), passed with `--encoder.t5_encoder` and
  `--encoder.clip_encoder`; d_model 4096 and hidden 768 stay, as flux-debug's context and vector widths need;
- a seed checkpoint, made by torchtitan itself (`--checkpoint.create_seed_checkpoint`, one process): on CPU meshes
  DTensor's random ops draw each shard from the local generator (torch's `is_rng_supported_mesh` is False for
  "cpu"), so FSDP-sharded initial weights differ with the layout; loading one seed checkpoint in both runs is
  torchtitan's own way to start every parallelism from the same weights;
- with `fixed=True`, a copy of the installed torchtitan with `synced_seeding.diff` applied (the one-line change:
  seeds distinct over the `batch` mesh, the data-parallel ranks, not over `fsdp`, which holds the CP ranks), to put
  first on PYTHONPATH.

    python examples/torchtitan_cpu/workspace.py SOURCE FOLDER     # prints the command to examine
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ASSETS = (
    "tests/assets/tokenizer/tokenizer.json",
    "tests/assets/tokenizer/tokenizer_config.json",
    "tests/assets/cc12m_test/cc12m-train-0000.tar",
)
SEED = 1234


@dataclass(frozen=True)
class Workspace:
    folder: Path
    python: str

    def trainer_args(self) -> list[str]:
        """torchtitan's CLI: its FLUX test config, tiny encoders, 64-pixel images (16 image + 48 text tokens: a local
        length of 32 at CP 2), one sample per rank, the partial_dtensor backend (the default needs torch >= 2.14),
        a fixed seed, and the seed checkpoint loaded without saving anything."""
        return [
            "-m", "torchtitan.train", "--module", "torchtitan_recipes.tests.flux", "--config", "flux_debugmodel_test",
            "--parallelism.spmd_backend", "partial_dtensor", "--tokenizer.max_t5_encoding_len", "48",
            "--encoder.t5_encoder", str(HERE / "t5"), "--encoder.clip_encoder", str(HERE / "clip"),
            "--dataloader.img_size", "64", "--training.local_batch_size", "1", "--training.steps", "2",
            "--debug.seed", str(SEED),
        ]  # fmt: skip

    def command(self) -> list[str]:
        """The launch command with cpdoctor's placeholders (`{nproc}`, `{cp}`)."""
        torchrun = [self.python, "-m", "torch.distributed.run", "--nproc-per-node", "{nproc}"]
        seed = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(self.seed_checkpoint), "--checkpoint.load_only"]
        return [*torchrun, *self.trainer_args(), "--parallelism.context_parallel_degree", "{cp}", *seed]

    @property
    def seed_checkpoint(self) -> Path:
        return self.folder / "seed" / "checkpoint" / "step-0"

    @property
    def fixed(self) -> Path:
        return self.folder / "fixed"


def copy_assets(source: Path, folder: Path) -> None:
    """torchtitan's test assets from a checkout (files) or a bare git directory (HEAD's blobs)."""
    for name in ASSETS:
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (source / name).is_file():
            shutil.copyfile(source / name, target)
        else:
            blob = subprocess.run(["git", "--git-dir", str(source), "show", f"HEAD:{name}"], capture_output=True, check=True).stdout
            target.write_bytes(blob)


def make_seed_checkpoint(ws: Workspace) -> None:
    """torchtitan's own seed checkpoint (one process), run under cpdoctor's CPU shims (peer_impls/titan_cpu.py)."""
    if ws.seed_checkpoint.is_dir():
        return
    cmd = [ws.python, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "cpdoctor.peer_impls.titan_cpu", *ws.trainer_args()]
    cmd += ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--dump_folder", str(ws.folder / "seed")]
    cmd += ["--parallelism.data_parallel_shard_degree", "1"]
    subprocess.run(cmd, cwd=ws.folder, check=True, capture_output=True)


def make_fixed_copy(ws: Workspace) -> None:
    """The installed torchtitan copied, with synced_seeding.diff applied (checked: the line must be found)."""
    if (ws.fixed / "torchtitan").is_dir():
        return
    import torchtitan

    shutil.copytree(Path(torchtitan.__file__).parent, ws.fixed / "torchtitan")
    trainer = ws.fixed / "torchtitan" / "models" / "flux" / "trainer.py"
    diff = (HERE / "synced_seeding.diff").read_text().splitlines()
    old = next(line[1:] for line in diff if line.startswith("-") and not line.startswith("---"))
    new = next(line[1:] for line in diff if line.startswith("+") and not line.startswith("+++"))
    text = trainer.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"synced_seeding.diff does not apply to {trainer}: the line {old.strip()!r} is not there once")
    trainer.write_text(text.replace(old, new))


def prepare(source: Path, folder: Path, python: str = sys.executable, fixed: bool = False) -> Workspace:
    folder.mkdir(parents=True, exist_ok=True)
    ws = Workspace(folder, python)
    copy_assets(source, folder)
    make_seed_checkpoint(ws)
    if fixed:
        make_fixed_copy(ws)
    return ws


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    ws = prepare(Path(sys.argv[1]), Path(sys.argv[2]).resolve(), fixed=True)
    print(f"cd {ws.folder}")
    print("cpdoctor step --ring 2 --emulate torchtitan-cpu -- " + " ".join(ws.command()))
    print(f"PYTHONPATH={ws.fixed} cpdoctor step ...   # the same with the one-line change")
