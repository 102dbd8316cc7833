"""The profile in the HTML report: heat map with legend and live-memory curve, in Chromium."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn as nn
from fxopt.visualize import write_report
from fxopt.visualize.profile import profile_html

import fxopt


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


def test_profile_page_in_headless_chromium(renderer, browser, tmp_path: Path) -> None:
    model, x = ConvNet().eval(), torch.randn(2, 3, 32, 32)
    profile = fxopt.profile(model, (x,), warmup=1, repeat=2)
    page = tmp_path / "profile.html"
    page.write_text(profile_html(profile, renderer=renderer))
    seen = browser(page)
    assert seen.console == [], seen.console
    dom = seen.dom
    # the heat map: every graph node is drawn, coloured, with its share in its label
    assert 'id="heat_t_legend"' in dom and "% of time" in dom
    fills = re.findall(r'<g id="heat_t_graph_node\d+" class="node fx_node[^"]*">.*?fill="(#[0-9a-f]{6})"',
                       dom, re.S)
    assert len(fills) == len(profile.nodes)
    hottest = max(profile.nodes, key=lambda n: n.time_s)
    assert len(set(fills)) > 2  # a heat map, not one colour
    assert f"{100 * hottest.share:.1f}" in dom
    # the live-memory curve: a measured step line over every node, and the prediction
    assert dom.count('class="fx-memory-curve"') == 1
    measured = re.search(r'class="fx-measured"[^>]*points="([^"]+)"', dom).group(1)
    assert len(measured.split()) == 2 * len(profile.nodes)
    assert 'class="fx-predicted"' in dom


def test_optimize_with_profile_puts_it_in_the_report(renderer, tmp_path: Path) -> None:
    model, x = ConvNet().eval(), torch.randn(2, 3, 32, 32)
    gm = fxopt.optimize(model, example_inputs=(x,), profile=fxopt.profile)
    page = write_report(gm, tmp_path / "report.html", renderer=renderer).read_text()
    assert page.count('<section class="fx-profile" id="profile">') == 1
    assert 'id="heat_t_legend"' in page and 'class="fx-memory-curve"' in page
    assert "fuse_conv_bn_relu" in page[page.index('id="profile"'):]
