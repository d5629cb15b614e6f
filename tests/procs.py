"""Helpers for the tests that run adapt in subprocesses (torchrun, the CLI)."""
import socket


def open_port() -> str:
    """A TCP port nobody listens on now, for a torch.distributed rendezvous (fixed ports collide)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def failure(stderr: str, n: int = 3000) -> str:
    """What to show when a subprocess failed: the first failing worker's own lines (``[rankN]:`` of the lowest rank
    other than 0 that printed any, else rank 0's), then the tail. torchrun's tail holds only the launcher's summary
    and rank 0's reaction to a peer that died, not the peer's error."""
    lines = stderr.splitlines()
    for rank in [*range(1, 8), 0]:
        own = [line for line in lines if line.startswith(f"[rank{rank}]:")]
        if own:
            return "\n".join(own)[:n] + "\n...\n" + stderr[-n:]
    return stderr[-n:]
