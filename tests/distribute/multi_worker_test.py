"""`fit` under MultiWorkerMirroredStrategy: two worker processes on
127.0.0.1 end with the weights of a single-process run."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.distribute import multi_worker_worker

pytestmark = pytest.mark.multi_device

WORKERS = 2
TIMEOUT_SECONDS = 240
ROOT = Path(__file__).resolve().parents[2]


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _run_workers(tmp_path):
    ports = ",".join(str(p) for p in _free_ports(WORKERS))
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    env.pop("TF_CONFIG", None)
    outputs = [tmp_path / f"worker_{i}.npz" for i in range(WORKERS)]
    logs = [open(tmp_path / f"worker_{i}.log", "w") for i in range(WORKERS)]
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.distribute.multi_worker_worker",
                str(i),
                ports,
                str(outputs[i]),
            ],
            cwd=ROOT,
            env=env,
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i in range(WORKERS)
    ]
    try:
        codes = [w.wait(timeout=TIMEOUT_SECONDS) for w in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        for log in logs:
            log.close()
    for i, code in enumerate(codes):
        assert code == 0, (tmp_path / f"worker_{i}.log").read_text()[-3000:]
    return [dict(np.load(path)) for path in outputs]


def test_two_workers_on_loopback_equal_one_process(tmp_path):
    workers = _run_workers(tmp_path)
    for name in multi_worker_worker.OPTIMIZERS:
        reference = multi_worker_worker.train(name)
        for key, expected in reference.items():
            for worker in workers:
                np.testing.assert_allclose(
                    worker[f"{name}/{key}"],
                    expected,
                    rtol=1e-5,
                    atol=2e-6,
                    err_msg=f"{name}/{key}",
                )
