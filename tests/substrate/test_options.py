"""substrate.options: flags generated from frozen dataclasses, one vocabulary everywhere."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from substrate.options import add_dataclass_args, flag_of, from_args, option, option_flags

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Alpha:
    rate: float = option(0.5, "a rate")
    name: str = option("x", "a name", choices=("x", "y"))
    limit: int | None = option(None, "optional limit", metavar="N")
    verbose: bool = option(False, "say more")
    feedback: bool = option(True, "on by default")
    hidden: int = option(3, cli=False)
    out: Path | None = option(None, "where", type=Path)  # noqa: RUF009 (option() builds the field, as in every options dataclass)

    def __post_init__(self):
        if not self.rate > 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")


@dataclass(frozen=True)
class Beta:
    rate: float = option(0.5, "same meaning, same default: shared")


@dataclass(frozen=True)
class Clash:
    rate: float = option(0.25, "same name, other default")


def test_fields_become_flags_and_come_back():
    p = add_dataclass_args(argparse.ArgumentParser(), Alpha, "alpha")
    args = p.parse_args(["--rate", "2", "--name", "y", "--limit", "7", "--verbose",
                         "--no-feedback", "--out", "o"])
    a = from_args(Alpha, args)
    assert a == Alpha(rate=2.0, name="y", limit=7, verbose=True, feedback=False, hidden=3,
                      out=Path("o"))
    assert from_args(Alpha, p.parse_args([])) == Alpha()
    assert not hasattr(args, "hidden")


def test_flag_spelling():
    assert flag_of(Alpha, "feedback") == "--no-feedback"
    assert flag_of(Alpha, "verbose") == "--verbose"
    assert option_flags(Alpha) == {"rate": "--rate", "name": "--name", "limit": "--limit",
                                   "verbose": "--verbose", "feedback": "--no-feedback",
                                   "out": "--out"}


def test_shared_flags_and_clashes():
    p = argparse.ArgumentParser()
    add_dataclass_args(p, Alpha)
    add_dataclass_args(p, Beta)            # same default: one shared flag
    assert from_args(Beta, p.parse_args(["--rate", "3"])).rate == 3.0
    with pytest.raises(ValueError, match="--rate is declared twice"):
        add_dataclass_args(p, Clash)


def test_a_flag_declared_by_hand_is_shared_only_if_it_agrees():
    p = argparse.ArgumentParser()
    p.add_argument("--rate", type=float, default=0.5)
    add_dataclass_args(p, Beta)
    p2 = argparse.ArgumentParser()
    p2.add_argument("--rate", type=float, default=9.0)
    with pytest.raises(ValueError, match="--rate is declared twice"):
        add_dataclass_args(p2, Beta)


def test_bad_values_are_refused_by_the_dataclass():
    p = add_dataclass_args(argparse.ArgumentParser(), Alpha)
    with pytest.raises(ValueError, match="--rate must be > 0"):
        from_args(Alpha, p.parse_args(["--rate", "0"]))
    with pytest.raises(SystemExit):
        p.parse_args(["--name", "z"])
    with pytest.raises(TypeError, match="needs a dataclass"):
        add_dataclass_args(p, object)


CHOICE_CLASSES = [("simulation.jobsim", "JobSimOptions"), ("hsadmm.config", "HSADMMConfig"),
                  ("dataparallel.ddp", "DDPOptions"), ("dataparallel.sdp.options", "SDPOptions"),
                  ("dataparallel.pactrain.options", "PacTrainOptions"),
                  ("dataparallel.ssfusion.options", "SSFusionOptions"),
                  ("sparse_sgd.plan", "HSGDOptions"), ("sparse_sgd.cli", "TrainConfig")]


@pytest.mark.parametrize("module,name", CHOICE_CLASSES)
def test_every_choice_is_checked_from_the_option_metadata(module, name):
    """An options object built in Python is held to the choices its flags declare: each field
    with ``choices`` refuses an unknown value, naming the flag and the valid values."""
    cls = getattr(importlib.import_module(module), name)
    fields = [f for f in dataclasses.fields(cls) if "choices" in f.metadata]
    assert fields, f"{name} declares no choices"
    for f in fields:
        flag = flag_of(cls, f.name)
        with pytest.raises(ValueError, match=f"^{flag} 'bogus' unknown; use one of "
                                             f"{', '.join(map(str, f.metadata['choices']))}$"):
            cls(**{f.name: "bogus"})


def _help(module, *sub):
    r = subprocess.run([sys.executable, "-m", module, *sub, "--help"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout


COMMON = ("--out", "--seed", "--device", "--overwrite", "--intra-bw", "--inter-bw",
          "--intra-lat", "--inter-lat")


@pytest.mark.parametrize("cmd", [("hsadmm", "train"), ("dataparallel", "train"), ("runner.probe",)])
def test_every_runner_takes_the_common_set(cmd):
    text = _help(*cmd)
    for flag in (*COMMON, "--ranks-per-node", "--collectives"):
        assert flag in text, (cmd, flag)
    assert "--batch " not in text and "--iterations" not in text and "--save" not in text


def test_commvol_commands_take_the_cost_flags():
    for sub in ("predict", "scale"):
        text = _help("commvol", sub)
        for flag in ("--intra-bw", "--inter-bw", "--intra-lat", "--inter-lat", "--batch-size"
                     if sub == "scale" else "--seed"):
            assert flag in text, (sub, flag)
