"""DeepSpeed's hostfile (`worker-0 slots=8`) and its `--include/--exclude` filters (`host:0,1@host2`).

Errors name the file, the line number and what a correct line looks like, so a typo in a 64-node hostfile
is found before any ssh connection is opened.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

from paratrain.errors import Error

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*(#.*)?$")


class HostfileError(Error, ValueError):
    pass


def parse_hostfile(text: str, source: str = "hostfile") -> OrderedDict[str, int]:
    """{host: slots} in file order. Blank lines and `#` comments are ignored."""
    hosts: OrderedDict[str, int] = OrderedDict()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise HostfileError(f"{source} line {number}: {raw.strip()!r} is not 'HOST slots=N' "
                                f"(e.g. 'worker-0 slots=8'); fix or comment out the line")
        host, slots = match.group(1), int(match.group(2))
        if slots < 1:
            raise HostfileError(f"{source} line {number}: host {host!r} has slots={slots}; use slots >= 1")
        if host in hosts:
            raise HostfileError(f"{source} line {number}: host {host!r} is listed twice; keep one line per host")
        hosts[host] = slots
    if not hosts:
        raise HostfileError(f"{source} lists no hosts; add lines like 'worker-0 slots=8'")
    return hosts


def read_hostfile(path: str | Path) -> OrderedDict[str, int]:
    path = Path(path)
    if not path.is_file():
        raise HostfileError(f"hostfile {str(path)!r} does not exist; pass --hostfile PATH of a file with lines "
                            f"'HOST slots=N'")
    return parse_hostfile(path.read_text(), source=f"hostfile {str(path)!r}")


def _parse_filter(spec: str, flag: str) -> OrderedDict[str, list[int]]:
    """'h1:0,1@h2' -> {h1: [0, 1], h2: []} (an empty list means every slot)."""
    out: OrderedDict[str, list[int]] = OrderedDict()
    for part in spec.split("@"):
        if not part:
            raise HostfileError(f"{flag} {spec!r}: empty host entry; use HOST[:SLOT,...][@HOST...]")
        host, _, slots = part.partition(":")
        try:
            out[host] = [int(s) for s in slots.split(",")] if slots else []
        except ValueError:
            raise HostfileError(f"{flag} {spec!r}: slots of {host!r} must be integers, e.g. {host}:0,1") from None
    return out


def filter_hosts(hosts: OrderedDict[str, int], include: str = "", exclude: str = "") -> OrderedDict[str, list[int]]:
    """Apply --include or --exclude; returns {host: [slot indices]} for the hosts that remain."""
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive; use one of them")
    slots: OrderedDict[str, list[int]] = OrderedDict((h, list(range(n))) for h, n in hosts.items())
    if not include and not exclude:
        return slots
    flag = "--include" if include else "--exclude"
    chosen = _parse_filter(include or exclude, flag)
    for host, picks in chosen.items():
        if host not in slots:
            raise HostfileError(f"{flag}: host {host!r} is not in the hostfile (hosts: {', '.join(slots)})")
        bad = [s for s in picks if s not in slots[host]]
        if bad:
            raise HostfileError(f"{flag}: host {host!r} has slots 0..{hosts[host] - 1}, not {bad}")
    if include:
        return OrderedDict((h, picks or slots[h]) for h, picks in chosen.items())
    out: OrderedDict[str, list[int]] = OrderedDict()
    for host, available in slots.items():
        picks = chosen.get(host)
        if picks is None:
            out[host] = available
        elif picks:  # exclude some slots of this host
            remaining = [s for s in available if s not in picks]
            if remaining:
                out[host] = remaining
    if not out:
        raise HostfileError(f"--exclude {exclude!r} leaves no host to run on")
    return out


def limit(hosts: OrderedDict[str, list[int]], num_nodes: int | None, slots_per_node: int | None):
    """DeepSpeed's --num_nodes (first N hosts) and --num_gpus (first N slots of each host)."""
    items = list(hosts.items())
    if num_nodes is not None:
        if num_nodes > len(items):
            raise HostfileError(f"--num_nodes {num_nodes} but only {len(items)} host(s) are available")
        items = items[:num_nodes]
    if slots_per_node is not None:
        short = [h for h, s in items if len(s) < slots_per_node]
        if short:
            raise HostfileError(f"--num_gpus {slots_per_node} but host(s) {', '.join(short)} have fewer slots")
        items = [(h, s[:slots_per_node]) for h, s in items]
    return OrderedDict(items)
