"""Feasibility probe for NixlConnector (issue 29): two processes, NIXL agents with the UCX backend, DRAM only.

The target registers a host buffer (DRAM_SEG) and publishes its agent metadata and the buffer's (address, length)
on a TCP socket; the initiator registers its own buffer, loads the metadata and NIXL-READs the bytes. Prints the
nixl version, the chosen backend package, the bytes read and whether they match. Usage: python bench/nixl_probe.py
"""

import json
import socket
import subprocess
import sys
import time
from importlib.metadata import version

import torch
from nixl._api import nixl_agent, nixl_agent_config

N = 1 << 20


def target() -> None:
    agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    buf = torch.arange(N, dtype=torch.int32).view(torch.uint8)  # 4 MiB of known bytes
    agent.register_memory(buf)
    srv = socket.create_server(("127.0.0.1", 0))
    print("PORT", srv.getsockname()[1], flush=True)  # nixl logs to stdout too
    conn, _ = srv.accept()
    meta = agent.get_agent_metadata()
    conn.sendall(json.dumps({"md": meta.hex(), "addr": buf.data_ptr(), "len": buf.numel()}).encode() + b"\n")
    conn.makefile().readline()  # initiator says done
    conn.close()


def initiator() -> None:
    proc = subprocess.Popen([sys.executable, __file__, "target"], stdout=subprocess.PIPE, text=True)
    port = int(next(line for line in proc.stdout if line.startswith("PORT")).split()[1])
    agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
    dst = torch.zeros(4 * N, dtype=torch.uint8)
    agent.register_memory(dst)
    sock = socket.create_connection(("127.0.0.1", port))
    info = json.loads(sock.makefile().readline())
    peer = agent.add_remote_agent(bytes.fromhex(info["md"]))
    remote = agent.get_xfer_descs([(info["addr"], info["len"], 0)], "DRAM")
    local = agent.get_xfer_descs(dst)
    t0 = time.perf_counter()
    handle = agent.initialize_xfer("READ", local, remote, peer)
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    dt = time.perf_counter() - t0
    ok = torch.equal(dst, torch.arange(N, dtype=torch.int32).view(torch.uint8))
    print(f"nixl {version('nixl')} ({agent.__module__}), torch {torch.__version__}: READ {dst.numel()} B "
          f"state={state} match={ok} in {dt * 1e3:.2f} ms; backend {agent.query_xfer_backend(handle)}")
    agent.release_xfer_handle(handle)
    sock.sendall(b"done\n")
    proc.wait(timeout=30)


if __name__ == "__main__":
    target() if sys.argv[1:] == ["target"] else initiator()
