#!/usr/bin/env python3
"""Checks the cluster map as a browser built it (the DOM Chromium dumps).

  map_check.py cluster DOM EXPECT   EXPECT is JSON: {"nodes": [names],
      "cells": [{"device", "instance", "replica", "shard"}], "unhealthy": [device IDs]}:
      every node has its row, every planned device's cell names its instance and shard,
      every unhealthy device's cell is marked.
  map_check.py instance DOM TEXT    the instance page shows TEXT (markup included) as
      the text of a condition message, and the DOM holds no script element at all.

Exits 1 naming what is missing.
"""
import json
import sys
from html.parser import HTMLParser

VOID = {"meta", "link", "br", "img", "input", "hr", "col", "area", "base", "wbr", "source"}


class Dom(HTMLParser):
    """Element records with their attributes, text and enclosing elements."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack = []
        self.elements = []
        self.scripts = 0

    def handle_starttag(self, tag, attrs):
        if tag == "script":
            self.scripts += 1
        element = {"tag": tag, "attrs": dict(attrs), "text": "", "parents": list(self.stack)}
        self.elements.append(element)
        if tag not in VOID:
            self.stack.append(element)

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i]["tag"] == tag:
                del self.stack[i:]
                break

    def handle_data(self, data):
        for element in self.stack:
            element["text"] += data


def parse(path):
    dom = Dom()
    with open(path, encoding="utf-8") as f:
        dom.feed(f.read())
    return dom


def classes(element):
    return element["attrs"].get("class", "").split()


def cluster(dom, expect):
    problems = []
    rows = {e["attrs"]["data-node"] for e in dom.elements if "data-node" in e["attrs"]}
    for node in expect["nodes"]:
        if node not in rows:
            problems.append(f"node {node} has no row")
    # The innermost cell (a GPU or a partition) each holder sits in.
    held = {}
    for e in dom.elements:
        if "data-instance" in e["attrs"] and "data-shard" in e["attrs"]:
            cell = next((p for p in reversed(e["parents"]) if "data-device" in p["attrs"]), None)
            if cell is not None:
                held.setdefault(cell["attrs"]["data-device"], []).append(
                    (e["attrs"]["data-instance"], e["attrs"].get("data-replica"), e["attrs"]["data-shard"], e["text"])
                )
    for want in expect["cells"]:
        holders = held.get(want["device"], [])
        match = [h for h in holders
                 if h[0] == want["instance"] and h[1] == str(want["replica"]) and h[2] == str(want["shard"])
                 and f"shard {want['shard']}" in h[3]]
        if not match:
            problems.append(f"the cell of {want['device']} does not name {want['instance']} shard "
                            f"{want['shard']} (it has {holders})")
    marked = {e["attrs"]["data-device"] for e in dom.elements
              if "data-device" in e["attrs"] and "unhealthy" in classes(e)}
    for device in expect["unhealthy"]:
        if device not in marked:
            problems.append(f"unhealthy device {device} is not marked")
    if dom.scripts:
        problems.append(f"the map holds {dom.scripts} script elements")
    return problems, f"{len(rows)} node rows, {sum(len(v) for v in held.values())} holders, {len(marked)} unhealthy"


def instance(dom, text):
    problems = []
    messages = [e["text"] for e in dom.elements if e["tag"] == "td" and "message" in classes(e)]
    if not any(text in m for m in messages):
        problems.append(f"no condition or event message shows {text!r} as text: {messages}")
    if dom.scripts:
        problems.append(f"the page holds {dom.scripts} script elements: markup from the cluster ran")
    return problems, f"{len(messages)} messages, {text!r} shown as text"


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("cluster", "instance"):
        sys.exit(__doc__)
    dom = parse(sys.argv[2])
    if sys.argv[1] == "cluster":
        problems, summary = cluster(dom, json.loads(sys.argv[3]))
    else:
        problems, summary = instance(dom, sys.argv[3])
    if problems:
        print("\n".join(problems))
        sys.exit(1)
    print(summary)


if __name__ == "__main__":
    main()
