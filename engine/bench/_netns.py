"""Nodes on one machine: Linux network namespaces joined by a private bridge, for the multi-node
tests and `omniflow bench transfer --across-nodes`. Needs root and `ip` (iproute2).

    with Lan.make(["a", "b"]) as lan:             # or Lan.unavailable() -> the reason it cannot
        lan.host_address                          # 10.x.y.1: this (root) namespace on the LAN
        lan.nodes["a"].address                    # 10.x.y.2, inside namespace a
        subprocess.Popen([*lan.nodes["a"].exec_prefix, sys.executable, ...])

Layout: a namespace of its own holds the bridge (`br0`), so nothing but one veth end is added
to the machine's own namespace (`ofh<tag>`, holding `host_address`), and no forwarding or
firewall setting of the machine changes. Each node namespace gets loopback and `eth0` on the
bridge. Addresses come from a /24 of 10.0.0.0/8 that no interface of this namespace uses; all
traffic stays between this namespace and the namespaces made here.

Namespaces are named `omniflow-<pid>-<tag>-<node>` (`omniflow-<pid>-<tag>-lan` for the
bridge). `close()` kills every process left in them and deletes them; `reclaim()` deletes
those of processes that died without closing (a killed test run).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import TracebackType

PREFIX = "omniflow"
_NAME = re.compile(rf"^{PREFIX}-(?P<pid>\d+)-(?P<tag>[0-9a-f]{{6}})-(?P<node>[a-z0-9]+)$")
_NODE = re.compile(r"^[a-z0-9]{1,8}$")
IP_TIMEOUT_S = 20.0


class NetnsError(RuntimeError):
    """A namespace, link or address could not be made."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def _in(ns: str, *args: str) -> None:
    _ip("netns", "exec", ns, "ip", *args)


@dataclass(frozen=True, slots=True)
class NetNode:
    name: str
    namespace: str
    address: str

    @property
    def exec_prefix(self) -> list[str]:
        """The command prefix that runs a program inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace]


@dataclass
class Lan:
    tag: str
    subnet: ipaddress.IPv4Network
    nodes: dict[str, NetNode] = field(default_factory=dict)
    _made: list[str] = field(default_factory=list)

    @property
    def lan_namespace(self) -> str:
        return f"{PREFIX}-{os.getpid()}-{self.tag}-lan"

    @property
    def host_link(self) -> str:
        return f"ofh{self.tag}"

    @property
    def host_address(self) -> str:
        return str(self.subnet.network_address + 1)

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here (None: they can)."""
        if not hasattr(os, "geteuid") or os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None:
            return "network namespaces need `ip` (iproute2)"
        probe = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-probe"
        try:
            done = _ip("netns", "add", probe, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"`ip netns add` failed: {exc}"
        if done.returncode != 0:
            return f"`ip netns add` failed: {done.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    @classmethod
    def make(cls, names: Iterable[str]) -> Lan:
        """A LAN with a node namespace per name (1-8 lowercase letters or digits)."""
        names = list(names)
        for name in names:
            if not _NODE.match(name) or name == "lan":
                raise ValueError(f"node name {name!r}: 1-8 lowercase letters or digits, not 'lan'")
        reclaim()
        lan = cls(secrets.token_hex(3), _free_subnet())
        try:
            lan._bridge()
            for i, name in enumerate(names):
                lan._node(i, name)
        except BaseException:  # an interrupt too: namespaces half made are deleted, then it goes on
            lan.close()
            raise
        return lan

    def _bridge(self) -> None:
        ns = self.lan_namespace
        _ip("netns", "add", ns)
        self._made.append(ns)
        _in(ns, "link", "set", "lo", "up")
        _in(ns, "link", "add", "br0", "type", "bridge")
        _in(ns, "link", "set", "br0", "up")
        _ip("link", "add", self.host_link, "type", "veth", "peer", "name", f"ofl{self.tag}")
        _ip("link", "set", f"ofl{self.tag}", "netns", ns)
        _in(ns, "link", "set", f"ofl{self.tag}", "master", "br0")
        _in(ns, "link", "set", f"ofl{self.tag}", "up")
        _ip("addr", "add", f"{self.host_address}/{self.subnet.prefixlen}", "dev", self.host_link)
        _ip("link", "set", self.host_link, "up")

    def _node(self, index: int, name: str) -> None:
        ns = f"{PREFIX}-{os.getpid()}-{self.tag}-{name}"
        address = str(self.subnet.network_address + 2 + index)
        _ip("netns", "add", ns)
        self._made.append(ns)
        inner, outer = f"ofi{index}{self.tag}", f"ofo{index}{self.tag}"
        _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", outer, "netns", self.lan_namespace)
        _in(self.lan_namespace, "link", "set", outer, "master", "br0")
        _in(self.lan_namespace, "link", "set", outer, "up")
        _in(ns, "link", "set", "lo", "up")
        _in(ns, "link", "set", inner, "name", "eth0")
        _in(ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        _in(ns, "link", "set", "eth0", "up")
        self.nodes[name] = NetNode(name, ns, address)

    def close(self) -> None:
        """Kill what still runs in the namespaces, then delete them (and the host's veth end)."""
        for ns in reversed(self._made):
            _delete(ns)
        self._made.clear()
        _ip("link", "del", self.host_link, check=False)

    def __enter__(self) -> Lan:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _delete(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", ns, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reclaim() -> list[str]:
    """Delete the namespaces (and their processes) of test runs whose process is gone."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAME.match(name)
        if match and not _pid_alive(int(match["pid"])):
            _delete(name)
            gone.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        found = re.search(r"\d+: (ofh[0-9a-f]{6})@", line)
        if found and not any(n.endswith(found[1][3:] + "-lan") for n in _ip("netns", "list").stdout.split()):
            _ip("link", "del", found[1], check=False)
    return gone


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no interface or route of this namespace overlaps."""
    used = []
    for line in _ip("-o", "addr", "show").stdout.splitlines() + _ip("route", "show").stdout.splitlines():
        for token in line.split():
            with contextlib.suppress(ValueError):
                if "/" in token or re.match(r"^\d+\.\d+\.\d+\.\d+$", token):
                    used.append(ipaddress.ip_network(token, strict=False))
    rng = random.Random()
    for _ in range(200):
        candidate = ipaddress.ip_network(f"10.{rng.randrange(200, 250)}.{rng.randrange(0, 256)}.0/24")
        if not any(candidate.overlaps(u) for u in used if u.version == 4 and u.prefixlen > 0):
            return candidate
    raise NetnsError("no free /24 in 10.200.0.0-10.249.255.0 for a test LAN")
