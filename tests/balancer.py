"""nginx on loopback in front of gateway replicas, for the scale-out tests."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["Nginx", "nginx_available"]


def nginx_available() -> str | None:
    """Path of the nginx binary, or None."""
    return shutil.which("nginx") or (str(Path("/usr/sbin/nginx")) if Path("/usr/sbin/nginx").exists() else None)


class Nginx:
    """A private nginx (own prefix, config, pid and logs) balancing ``upstream_ports``."""

    def __init__(self, workdir: Path, port: int, upstream_ports: list[int]) -> None:
        self.workdir = workdir
        self.port = port
        self.upstream_ports = upstream_ports
        self.proc: subprocess.Popen[bytes] | None = None

    def _config(self) -> str:
        servers = "\n".join(f"        server 127.0.0.1:{p} max_fails=1 fail_timeout=2s;" for p in self.upstream_ports)
        return f"""
worker_processes 1;
daemon off;
pid {self.workdir}/nginx.pid;
error_log {self.workdir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {self.workdir}/body;
    proxy_temp_path {self.workdir}/proxy;
    fastcgi_temp_path {self.workdir}/fastcgi;
    uwsgi_temp_path {self.workdir}/uwsgi;
    scgi_temp_path {self.workdir}/scgi;
    upstream llm_gateway {{
{servers}
        keepalive 16;
    }}
    server {{
        listen 127.0.0.1:{self.port};
        location / {{
            proxy_pass http://llm_gateway;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 60s;
            proxy_next_upstream error;
            proxy_next_upstream_tries 2;
        }}
    }}
}}
"""

    def start(self) -> None:
        binary = nginx_available()
        assert binary is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "nginx.conf"
        conf.write_text(self._config())
        self.proc = subprocess.Popen(
            [binary, "-c", str(conf), "-p", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        time.sleep(0.3)
        if self.proc.poll() is not None:
            raise RuntimeError((self.workdir / "error.log").read_text(errors="replace"))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
