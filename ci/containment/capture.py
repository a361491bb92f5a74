"""Read the browser namespace's packet capture (a pcap file tcpdump wrote) without extra libraries.

Only what the smoke test needs: for every outgoing frame, its protocol, addresses and ports, so each
packet can be judged "to the proxy's address and port" or not.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass
from pathlib import Path

PROTOCOLS = {1: "ICMP", 2: "IGMP", 6: "TCP", 17: "UDP", 58: "ICMPv6", 132: "SCTP"}
WELL_KNOWN = {53: "DNS", 443: "HTTPS", 80: "HTTP", 3478: "STUN", 5353: "mDNS", 1900: "SSDP", 5355: "LLMNR",
              137: "NetBIOS", 67: "DHCP", 68: "DHCP", 123: "NTP"}


@dataclass(frozen=True)
class Packet:
    time: float
    kind: str  # "ARP", "IPv4", "IPv6", "other"
    proto: str = ""
    src: str = ""
    dst: str = ""
    sport: int | None = None
    dport: int | None = None

    def describe(self) -> str:
        if self.kind in ("ARP", "other"):
            return self.kind
        where = f"{self.dst}:{self.dport}" if self.dport is not None else self.dst
        if ":" in self.dst and self.dport is not None:
            where = f"[{self.dst}]:{self.dport}"
        label = WELL_KNOWN.get(self.dport or -1, "")
        if self.dst.startswith("224.") or self.dst.startswith("ff0"):
            label = label or "multicast"
        return f"{self.proto} -> {where}" + (f" ({label})" if label else "")


def read_pcap(path: Path) -> list[Packet]:
    data = path.read_bytes() if path.exists() else b""
    if len(data) < 24:
        return []
    magic = data[:4]
    if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1"):
        endian, nano = "<", magic == b"\x4d\x3c\xb2\xa1"
    elif magic in (b"\xa1\xb2\xc3\xd4", b"\xa1\xb2\x3c\x4d"):
        endian, nano = ">", magic == b"\xa1\xb2\x3c\x4d"
    else:
        raise ValueError(f"{path}: not a pcap file")
    linktype = struct.unpack(endian + "I", data[20:24])[0]
    packets, offset = [], 24
    while offset + 16 <= len(data):
        sec, frac, caplen, _ = struct.unpack(endian + "IIII", data[offset:offset + 16])
        frame = data[offset + 16:offset + 16 + caplen]
        offset += 16 + caplen
        when = sec + frac / (1e9 if nano else 1e6)
        packets.append(_parse_frame(when, frame, linktype))
    return packets


def _parse_frame(when: float, frame: bytes, linktype: int) -> Packet:
    if linktype == 1:  # Ethernet
        ethertype, payload = struct.unpack("!H", frame[12:14])[0], frame[14:]
        while ethertype == 0x8100 and len(payload) >= 4:  # VLAN tags
            ethertype, payload = struct.unpack("!H", payload[2:4])[0], payload[4:]
    elif linktype == 113:  # Linux cooked (tcpdump -i any)
        ethertype, payload = struct.unpack("!H", frame[14:16])[0], frame[16:]
    else:
        return Packet(when, "other")
    if ethertype == 0x0806:
        return Packet(when, "ARP")
    if ethertype == 0x0800 and len(payload) >= 20:
        ihl = (payload[0] & 0x0F) * 4
        proto = payload[9]
        src, dst = str(ipaddress.IPv4Address(payload[12:16])), str(ipaddress.IPv4Address(payload[16:20]))
        return _l4(when, "IPv4", proto, src, dst, payload[ihl:])
    if ethertype == 0x86DD and len(payload) >= 40:
        proto = payload[6]
        src, dst = str(ipaddress.IPv6Address(payload[8:24])), str(ipaddress.IPv6Address(payload[24:40]))
        rest = payload[40:]
        while proto in (0, 43, 60) and len(rest) >= 8:  # hop-by-hop, routing, destination options
            proto, rest = rest[0], rest[(rest[1] + 1) * 8:]
        return _l4(when, "IPv6", proto, src, dst, rest)
    return Packet(when, "other")


def _l4(when: float, kind: str, proto: int, src: str, dst: str, rest: bytes) -> Packet:
    name = PROTOCOLS.get(proto, f"proto-{proto}")
    if proto in (6, 17, 132) and len(rest) >= 4:
        sport, dport = struct.unpack("!HH", rest[:4])
        return Packet(when, kind, name, src, dst, sport, dport)
    return Packet(when, kind, name, src, dst)
