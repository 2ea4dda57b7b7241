"""A P/D deployment (1P1D by default; `num_prefill` x `num_decode`) + router on this machine, started as
subprocesses and always torn down.

Colocated mode starts as many `--kv-role both` instances as the P/D deployment has (two for 1P1D: those where
prefill would run on --prefill-gpu, the others on --decode-gpu; same server flags otherwise) behind a
`pdserve proxy --mode colocated` router.

Startup order: prefill and decode (or both instances) together (they load the model in parallel), wait for
every /health, then the router, wait for its /health. Shutdown order (the reverse): router, decode, prefill
— so no request is routed to an instance that is already gone. `Deployment` is a context manager; leaving the block by
return, exception or Ctrl-C stops every process it started.

Ports: every server and the router start with `--port 0` (and side channels on port 0) and the deployment
reads back the port each bound (ManagedProcess.wait_port; pdserve/http_port.py says why not probed ports).

Each deployment gets its own deployment secret (auth.new_secret), written to <log_dir>/<mode>_kv_auth_secret
(mode 0600) and passed to every process with --kv-auth-secret-file: its transfer params and side channel are
authenticated as a production deployment's would be.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.auth import new_secret
from pdserve.bench.procs import ManagedProcess


@dataclass(frozen=True)
class ServerOptions:
    """Flags passed through to both `pdserve serve` instances; None = the server's default."""

    model: str  # a built-in name, a HF folder, a .gguf file or a shape preset
    dtype: str | None = None
    load_format: str | None = None
    block_size: int | None = None
    num_threads: int | None = None  # torch threads per server; 1 keeps four processes on two cores sane
    max_model_len: int | None = None
    device: str | None = None  # "cpu" or "cuda"
    prefill_gpu: int | None = None  # CUDA_VISIBLE_DEVICES of the prefill server
    decode_gpu: int | None = None  # CUDA_VISIBLE_DEVICES of the decode server
    extra_args: tuple[str, ...] = ()  # appended verbatim to both servers' command lines
    decode_prefix_caching: bool = False  # D keeps a prefix cache (kv-aware routing needs one); off: D never
    # shortcuts a transfer, as in the reference push/pull runs

    def server_flags(self) -> list[str]:
        flags = []
        for flag, value in (
            ("--dtype", self.dtype),
            ("--load-format", self.load_format),
            ("--block-size", self.block_size),
            ("--num-threads", self.num_threads),
            ("--max-model-len", self.max_model_len),
            ("--device", self.device),
        ):
            if value is not None:
                flags += [flag, str(value)]
        return flags + list(self.extra_args)


@dataclass
class Deployment:
    """`num_prefill` prefill + `num_decode` decode instances + router for one transfer mode (or, colocated, as
    many `--kv-role both` instances + router), on loopback ports chosen when started."""

    options: ServerOptions
    mode: str  # "push", "pull" or "colocated"
    log_dir: Path  # <log_dir>/<mode>_{prefill,decode,router}.log (prefill0, ... when several); colocated:
    # <mode>_instance{0,1,...}.log
    host: str = "127.0.0.1"
    startup_timeout_s: float = 600.0
    python: str = sys.executable
    procs: list[ManagedProcess] = field(default_factory=list)
    prefill_url: str = ""
    decode_url: str = ""
    router_url: str = ""
    secret_file: Path | None = None  # this deployment's secret (written by start())
    instance_urls: list[str] = field(default_factory=list)  # colocated: the `--kv-role both` instances
    router_args: tuple[str, ...] = ()  # appended verbatim to the router's command line
    num_prefill: int = 1  # prefill instances (colocated: num_prefill + num_decode instances)
    num_decode: int = 1  # decode instances
    prefill_urls: list[str] = field(default_factory=list)  # every prefill instance (prefill_url: the first)
    decode_urls: list[str] = field(default_factory=list)  # every decode instance (decode_url: the first)
    label: str = ""  # names its log and secret files instead of the mode (two deployments of one mode at once)

    @property
    def stem(self) -> str:
        return self.label or self.mode

    def _write_secret(self) -> Path:
        path = self.log_dir / f"{self.stem}_kv_auth_secret"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, not even briefly
        with os.fdopen(fd, "w") as f:
            f.write(new_secret() + "\n")
        return path

    def _auth_flags(self) -> list[str]:
        return [] if self.secret_file is None else ["--kv-auth-secret-file", str(self.secret_file)]

    def _serve_argv(self, role: str, port: int, side_port: int) -> list[str]:
        argv = [self.python, "-m", "pdserve.cli", "serve", self.options.model, "--host", self.host, "--port", str(port)]
        if role == "both":
            return argv + ["--kv-role", "both"] + self.options.server_flags()
        argv += ["--kv-role", role, "--kv-transfer", self.mode, "--kv-side-channel-port", str(side_port)]
        if role == "decode" and not self.options.decode_prefix_caching:
            argv.append("--no-enable-prefix-caching")  # as in the reference runs: D never shortcuts a transfer
        return argv + self._auth_flags() + self.options.server_flags()

    def _url(self, proc: ManagedProcess) -> str:
        """The base URL of a server started with `--port 0`, once it printed the port it bound."""
        return f"http://{self.host}:{proc.wait_port(self.startup_timeout_s)}"

    def _gpu_env(self, gpu: int | None) -> dict[str, str] | None:
        return None if gpu is None else {"CUDA_VISIBLE_DEVICES": str(gpu)}

    def start(self) -> Deployment:
        if self.mode == "colocated":
            return self._start_colocated()
        logs = self.log_dir
        self.secret_file = self._write_secret()
        try:
            started: dict[str, list[ManagedProcess]] = {"prefill": [], "decode": []}
            for role, count, gpu in (
                ("prefill", self.num_prefill, self.options.prefill_gpu),
                ("decode", self.num_decode, self.options.decode_gpu),
            ):
                for i in range(count):
                    name = role if count == 1 else f"{role}{i}"
                    proc = ManagedProcess(
                        name, self._serve_argv(role, 0, 0), logs / f"{self.stem}_{name}.log", self._gpu_env(gpu)
                    )
                    self.procs.append(proc)
                    started[role].append(proc)
            self.prefill_urls = [self._url(proc) for proc in started["prefill"]]
            self.decode_urls = [self._url(proc) for proc in started["decode"]]
            self.prefill_url, self.decode_url = self.prefill_urls[0], self.decode_urls[0]
            procs, urls = started["prefill"] + started["decode"], self.prefill_urls + self.decode_urls
            for proc, url in zip(procs, urls, strict=True):
                proc.wait_healthy(url + "/health", self.startup_timeout_s)
            router_argv = [self.python, "-m", "pdserve.cli", "proxy", "--mode", self.mode]
            router_argv += ["--port", "0", "--prefill", *self.prefill_urls, "--decode", *self.decode_urls]
            router_argv += self._auth_flags()
            router_argv += list(self.router_args)
            router = ManagedProcess("router", router_argv, logs / f"{self.stem}_router.log")
            self.procs.append(router)
            self.router_url = self._url(router)
            router.wait_healthy(self.router_url + "/health", self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_colocated(self) -> Deployment:
        try:
            # the devices the P/D deployment would use
            gpus = [self.options.prefill_gpu] * self.num_prefill + [self.options.decode_gpu] * self.num_decode
            for i, gpu in enumerate(gpus):
                argv = self._serve_argv("both", 0, 0)
                log_path = self.log_dir / f"{self.stem}_instance{i}.log"
                self.procs.append(ManagedProcess(f"instance{i}", argv, log_path, self._gpu_env(gpu)))
            self.instance_urls = [self._url(proc) for proc in self.procs]
            for proc, url in zip(self.procs, self.instance_urls, strict=True):
                proc.wait_healthy(url + "/health", self.startup_timeout_s)
            router_argv = [self.python, "-m", "pdserve.cli", "proxy", "--mode", "colocated"]
            router_argv += ["--port", "0", "--instance", *self.instance_urls, *self.router_args]
            router = ManagedProcess("router", router_argv, self.log_dir / f"{self.stem}_router.log")
            self.procs.append(router)
            self.router_url = self._url(router)
            router.wait_healthy(self.router_url + "/health", self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every process started, router first; safe to call twice."""
        while self.procs:
            self.procs.pop().stop()

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
