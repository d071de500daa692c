"""Read a rich display's HTML back with the standard library's parser: every element with its
attributes, and any reference to the network."""

from __future__ import annotations

import re
from html.parser import HTMLParser

#: Void elements (no end tag) in HTML.
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Elements(HTMLParser):
    """``elements``: (tag, attrs dict) in document order; ``unclosed``: tags opened and never closed."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str | None]]] = []
        self.open: list[str] = []
        self.mismatched: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))
        if tag not in VOID:
            self.open.append(tag)

    def handle_endtag(self, tag):
        if self.open and self.open[-1] == tag:
            self.open.pop()
        else:
            self.mismatched.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def parse(html: str) -> Elements:
    """Parse ``html``; fail when an end tag does not match or an element is left open."""
    p = Elements()
    p.feed(html)
    p.close()
    assert p.mismatched == [] and p.open == [], (p.mismatched, p.open)
    return p


def find(p: Elements, tag: str | None = None, **attrs: str | None) -> list[dict[str, str | None]]:
    """The attributes of every element of ``tag`` (any if None) having ``attrs`` (value None: present at all)."""
    found = []
    for t, a in p.elements:
        if tag not in (None, t):
            continue
        if all(k.replace("_", "-") in a and (v is None or a[k.replace("_", "-")] == v) for k, v in attrs.items()):
            found.append(a)
    return found


def network_references(html: str, p: Elements) -> list[str]:
    """``src``/``href``/``srcdoc``-free references to http(s) (attributes and the raw text alike)."""
    refs = [v for _, a in p.elements for k, v in a.items() if k in ("src", "href", "action", "data") and v and re.match(r"\s*(https?:)?//", v)]
    return refs + re.findall(r"https?://[^\s\"'<>]+", html)
