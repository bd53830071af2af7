#!/usr/bin/env python3
"""Checks the cluster map as a browser built it (the DOM Chromium dumps).

  map_check.py cluster DOM EXPECT   EXPECT is JSON: {"nodes": [names],
      "cells": [{"node", "index", "instance", "replica", "shard"}],
      "unhealthy": [{"node", "index"}]}: every node has its row, the cell of every planned
      GPU (by node and index) names its instance and shard, every unhealthy GPU's cell is
      marked.
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


def shard_text(want):
    """How a cell names a shard: `ns/name shard 1`, `ns/name replica 2 shard 1`."""
    replica = f"replica {want['replica']} " if int(want["replica"]) > 0 else ""
    return f"{want['instance']} {replica}shard {want['shard']}"


def cells(dom):
    """(node, GPU index) -> (the cell element, the texts of the holders inside it)."""
    found = {}
    for e in dom.elements:
        if e["tag"] == "div" and "g" in classes(e):
            row = next((p for p in reversed(e["parents"]) if "data-node" in p["attrs"]), None)
            index = next((c for c in dom.elements if c["tag"] == "b" and c["parents"] and c["parents"][-1] is e), None)
            if row is not None and index is not None:
                found[(row["attrs"]["data-node"], index["text"].strip())] = (e, [])
    for e in dom.elements:
        if "h" in classes(e) and "o" not in classes(e):
            cell = next((p for p in reversed(e["parents"]) if p["tag"] == "div" and "g" in classes(p)), None)
            for key, (element, holders) in found.items():
                if element is cell:
                    holders.append(e["text"].strip())
    return found


def cluster(dom, expect):
    problems = []
    rows = {e["attrs"]["data-node"] for e in dom.elements if "data-node" in e["attrs"]}
    for node in expect["nodes"]:
        if node not in rows:
            problems.append(f"node {node} has no row")
    found = cells(dom)
    for want in expect["cells"]:
        key = (want["node"], str(want["index"]))
        holders = found.get(key, (None, []))[1]
        if shard_text(want) not in holders:
            problems.append(f"the cell of {key[0]} GPU {key[1]} does not name {shard_text(want)!r} "
                            f"(it has {holders})")
    for sick in expect["unhealthy"]:
        cell = found.get((sick["node"], str(sick["index"])), (None, []))[0]
        if cell is None or "bad" not in classes(cell):
            problems.append(f"unhealthy {sick['node']} GPU {sick['index']} is not marked")
    if dom.scripts:
        problems.append(f"the map holds {dom.scripts} script elements")
    held = sum(len(h) for _, h in found.values())
    marked = sum(1 for e, _ in found.values() if "bad" in classes(e))
    return problems, f"{len(rows)} node rows, {len(found)} GPU cells, {held} holders, {marked} unhealthy"


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
