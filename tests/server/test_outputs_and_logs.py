"""Logs a user reads: a repeated warning is said once with its count, log files are plain text."""

from __future__ import annotations

import logging
import time
from typing import Any

from fedcybgd.deploy.local import LocalDeployment, plain_log_text
from fedcybgd.harness.loopback import run_in_process

TRUNCATION = "longer than max-seq-len"


def test_truncation_warning_is_said_once_per_run_with_its_count(tiny_run_config, tmp_path,
                                                               caplog):
    # Prepare: every review is longer than 8 tokens, so every client round and every
    # evaluation cuts examples; 3 rounds of 2 clients, evaluated after each round
    config: dict[str, Any] = dict(tiny_run_config, **{"num-server-rounds": 3,
                                                      "max-seq-len": 8, "eval-every": 1})
    # Execute
    with caplog.at_level(logging.DEBUG, logger="fedcybgd.tasks.base"):
        run_in_process(config, 4, tmp_path / "run")
    # Assert: one warning for training and one for evaluation, each with its count; the
    # other 5 client rounds and 3 evaluations are counted at DEBUG level
    said = [r for r in caplog.records if r.name == "fedcybgd.tasks.base"]
    warnings = [r.getMessage() for r in said if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    training = [m for m in warnings if "block" in m]
    evaluation = [m for m in warnings if m.startswith("evaluation")]
    assert len(training) == 1 and len(evaluation) == 1, warnings
    assert TRUNCATION in training[0] and "of 8 examples" in training[0]
    assert "said once" in training[0]
    counted = [r.getMessage() for r in said if r.levelno == logging.DEBUG]
    assert sum("block" in m for m in counted) == 5, counted
    assert sum(m.startswith("evaluation") for m in counted) == 3, counted
    assert any("so far: 48 of 48, 6 times" in m for m in counted), counted


def test_a_new_run_says_the_truncation_warning_again(tiny_run_config, tmp_path, caplog):
    # Prepare
    config: dict[str, Any] = dict(tiny_run_config, **{"num-server-rounds": 1,
                                                      "max-seq-len": 8})
    # Execute: two runs in one process (another seed: another run)
    with caplog.at_level(logging.WARNING, logger="fedcybgd.tasks.base"):
        run_in_process(config, 2, tmp_path / "first")
        run_in_process(dict(config, seed=1), 2, tmp_path / "second")
    # Assert
    training = [r for r in caplog.records
                if TRUNCATION in r.getMessage() and "block" in r.getMessage()]
    assert len(training) == 2


def test_plain_log_text_drops_ansi_codes_and_redrawn_progress_bars():
    # Prepare: Flower's coloured level, a tqdm bar redrawn with carriage returns
    raw = ("\x1b[92mINFO \x1b[0m:      Starting Flower SuperNode\n"
           "Loading:  10%|#         | 1/10\rLoading: 100%|##########| 10/10\r\n"
           "\x1b[93mWARNING \x1b[0m:   done\n")
    # Execute
    text = plain_log_text(raw)
    # Assert
    assert text == ("INFO :      Starting Flower SuperNode\n"
                    "Loading: 100%|##########| 10/10\n"
                    "WARNING :   done\n")


def test_deploy_log_files_are_plain_text_without_progress_bars(tmp_path):
    # Prepare: a process that colours its output, draws a bar and reports its environment
    script = ("import os, sys\n"
              "print('\\x1b[92mINFO \\x1b[0m: up', flush=True)\n"
              "sys.stderr.write('50%|#####     |\\r100%|##########|\\n')\n"
              "names = 'TQDM_DISABLE', 'HF_HUB_DISABLE_PROGRESS_BARS', 'NO_COLOR'\n"
              "print(*(os.environ.get(n) for n in names))\n")
    with LocalDeployment(tmp_path / "state", tmp_path / "logs") as dep:
        # Execute
        proc = dep._spawn("talker", ["python", "-c", script])
        deadline = time.monotonic() + 30
        while proc.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        dep.stop()
    # Assert
    text = (tmp_path / "logs" / "talker.log").read_text()
    assert "\x1b" not in text and "\r" not in text, repr(text)
    assert "INFO : up\n" in text and "100%|##########|\n" in text, text
    assert "1 1 1\n" in text, text
