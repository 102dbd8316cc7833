// fxopt report glue: zoom/pan (svg-pan-zoom does the work), diffs opened on their changes,
// node search, pass navigation.
// Inlined into the page after svg-pan-zoom; no network, no other library.
(function () {
  "use strict";
  var instances = new Map(); // figure element -> svg-pan-zoom instance

  // --- zoom and pan: one svg-pan-zoom per figure, created when it is first visible ---
  var READABLE_PX = 10; // the smallest label text of a diff's changes opens at least this tall
  function panZoom(figure) {
    if (instances.has(figure)) return instances.get(figure);
    var box = figure.getBoundingClientRect();
    // not laid out yet (a level just opened can intersect with no height): svg-pan-zoom would
    // fit the drawing at zoom 0, and every later zoom would invert a singular matrix
    if (!box.width || !box.height) return null;
    var svg = figure.querySelector("svg");
    svg.setAttribute("width", "100%");
    svg.setAttribute("height", "100%");
    var pz = svgPanZoom(svg, {
      controlIconsEnabled: true, zoomScaleSensitivity: 0.3, minZoom: 0.2, maxZoom: 60,
      fit: true, center: true, dblClickZoomEnabled: false
    });
    var s = pz.getSizes();
    // zoom is relative to the fitted drawing: on a very tall one, let it reach 4 px per unit
    pz.setMaxZoom(Math.max(60, 4 * pz.getZoom() / s.realZoom));
    instances.set(figure, pz);
    if (changedNodes(figure).length) {
      addWholeButton(figure);
      showChanges(figure);
    } else if (s.realZoom < 0.4) { // a tall graph shrunk to a speck: start at its top, width-fitted
      setRealZoom(pz, Math.min(1, s.width / s.viewBox.width));
      s = pz.getSizes();
      pz.pan({x: (s.width - s.viewBox.width * s.realZoom) / 2, y: 8});
    }
    return pz;
  }
  function setRealZoom(pz, real) { // real: screen px per SVG unit
    pz.zoom(real * pz.getZoom() / pz.getSizes().realZoom);
  }
  function changedNodes(figure) {
    return figure.querySelectorAll("g.node.fx_diff_added, g.node.fx_diff_removed, g.node.fx_diff_changed");
  }
  // a node's box in the coordinates svg-pan-zoom scales and pans (the DOM's transform lags
  // a frame behind its API, so positions on screen cannot be used)
  function boxOf(figure, node) {
    var viewport = figure.querySelector(".svg-pan-zoom_viewport");
    var m = viewport.getCTM().inverse().multiply(node.getCTM()), bb = node.getBBox();
    var a = figure.querySelector("svg").createSVGPoint(), b = figure.querySelector("svg").createSVGPoint();
    a.x = bb.x; a.y = bb.y; b.x = bb.x + bb.width; b.y = bb.y + bb.height;
    a = a.matrixTransform(m); b = b.matrixTransform(m);
    return {x0: Math.min(a.x, b.x), y0: Math.min(a.y, b.y), x1: Math.max(a.x, b.x), y1: Math.max(a.y, b.y)};
  }
  function centreOn(figure, box) {
    var pz = instances.get(figure), s = pz.getSizes();
    pz.pan({x: s.width / 2 - s.realZoom * (box.x0 + box.x1) / 2,
            y: s.height / 2 - s.realZoom * (box.y0 + box.y1) / 2});
  }
  // A diff opens on its changes, with their labels readable: all of them when they fit at
  // that size, else the first (topmost) one; "whole graph" (key f) fits the drawing.
  function showChanges(figure) {
    var pz = instances.get(figure), nodes = changedNodes(figure), smallest = Infinity;
    var all = {x0: Infinity, y0: Infinity, x1: -Infinity, y1: -Infinity}, first = null;
    nodes.forEach(function (n) {
      var b = boxOf(figure, n);
      all = {x0: Math.min(all.x0, b.x0), y0: Math.min(all.y0, b.y0), x1: Math.max(all.x1, b.x1), y1: Math.max(all.y1, b.y1)};
      if (!first || b.y0 < first.y0) first = b;
      n.querySelectorAll("text").forEach(function (t) {
        smallest = Math.min(smallest, parseFloat(t.getAttribute("font-size")) || 14);
      });
    });
    var s = pz.getSizes(), margin = 24, readable = READABLE_PX / (isFinite(smallest) ? smallest : 14);
    var fits = Math.min((s.width - 2 * margin) / (all.x1 - all.x0), (s.height - 2 * margin) / (all.y1 - all.y0));
    setRealZoom(pz, fits >= readable ? Math.min(fits, 1.5 * readable) : readable);
    centreOn(figure, fits >= readable ? all : first);
    // no empty margin where the drawing could fill the box (a change near an edge)
    var pan = pz.getPan();
    s = pz.getSizes();
    pz.pan({x: fill(pan.x, s.width, s.viewBox.width * s.realZoom),
            y: fill(pan.y, s.height, s.viewBox.height * s.realZoom)});
    labelView(figure, false);
  }
  function fill(pan, box, drawn) { // the pan along one axis that leaves no gap, if it can
    return drawn <= box ? (box - drawn) / 2 : Math.min(0, Math.max(box - drawn, pan));
  }
  function showWhole(figure) {
    var pz = instances.get(figure);
    pz.fit(); pz.center();
    labelView(figure, true);
  }
  function labelView(figure, whole) { // the button offers the other view
    figure.classList.toggle("fx-whole", whole);
    figure.querySelector(".fx-whole-button").textContent = whole ? "\u25CE changes (f)" : "\u2922 whole graph (f)";
  }
  function toggleWhole(figure) {
    if (!panZoom(figure)) return;
    if (figure.classList.contains("fx-whole")) showChanges(figure); else showWhole(figure);
  }
  function addWholeButton(figure) {
    var button = document.createElement("button");
    button.type = "button";
    button.className = "fx-whole-button";
    button.title = "toggle between the changes and the whole graph (key f)";
    button.addEventListener("click", function () { toggleWhole(figure); });
    figure.appendChild(button);
  }
  function figureInView() { // the drawing of a diff that shows most in the window
    var best = null, most = 0;
    document.querySelectorAll(".fx-zoom").forEach(function (f) {
      if (!changedNodes(f).length) return;
      var r = f.getBoundingClientRect();
      var seen = Math.max(0, Math.min(r.bottom, window.innerHeight) - Math.max(r.top, 0)) *
                 Math.max(0, Math.min(r.right, window.innerWidth) - Math.max(r.left, 0));
      if (seen > most) { most = seen; best = f; }
    });
    return best;
  }
  var figures = document.querySelectorAll(".fx-zoom");
  function whenLaidOut(figure, frames) { // zoom/pan once the figure has a size (a few frames)
    if (figure.isConnected && !panZoom(figure) && frames > 0) {
      requestAnimationFrame(function () { whenLaidOut(figure, frames - 1); });
    }
  }
  var observer = new IntersectionObserver(function (entries) {
    entries.forEach(function (e) {
      if (e.isIntersecting) { observer.unobserve(e.target); whenLaidOut(e.target, 60); }
    });
  });
  figures.forEach(function (f) { observer.observe(f); });

  // --- the final graph by module: one level at a time, a module box opens its level below ---
  // Levels that draw the same but for names share one drawing (outline.py); a copy gets
  // its own names written in: each name in a text (the same expression as names.py) is
  // looked up among the names the drawing was made with, and swapped for this level's.
  var NAME = /[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*/g;
  function outline(root) {
    var data = JSON.parse(root.getAttribute("data-outline")), stack = root.querySelector(".fx-levels");
    var levels = data.levels, drawnWith = data.drawnWith; // drawing -> the level whose names it shows
    function rename(text, slots, names) {
      return text.replace(NAME, function (m) { return slots.has(m) ? names[slots.get(m)] : m; });
    }
    function open(index, depth) {
      while (stack.children.length > depth) stack.removeChild(stack.lastChild);
      var lv = levels[index], own = levels[drawnWith[lv[0]]][1], slots = new Map();
      own.forEach(function (name, i) { slots.set(name, i); });
      var figure = root.querySelector('template[data-drawing="' + lv[0] + '"]').content.firstElementChild.cloneNode(true);
      if (drawnWith[lv[0]] !== index) {
        figure.querySelectorAll("text").forEach(function (t) { t.textContent = rename(t.textContent, slots, lv[1]); });
      }
      figure.querySelectorAll("g.node.fx_scope").forEach(function (g) {
        var box = /box(\d+)$/.exec(g.id)[1];
        g.style.cursor = "pointer";
        g.addEventListener("click", function () {
          figure.querySelectorAll("g.fx-open").forEach(function (o) { o.classList.remove("fx-open"); });
          g.classList.add("fx-open");
          open(lv[2][box], depth + 1).scrollIntoView({block: "nearest"});
        });
      });
      var level = document.createElement("div");
      level.className = "fx-level";
      level.setAttribute("data-level", index);
      var title = document.createElement("div");
      title.className = "fx-level-title";
      title.textContent = lv[3];
      level.appendChild(title);
      level.appendChild(figure);
      stack.appendChild(level);
      observer.observe(figure);
      return level;
    }
    // search reaches into levels not open yet: open the path down to the first level
    // (in graph order: a node's own block before the blocks that read it) drawing that name
    var parent = {};
    levels.forEach(function (lv, i) { Object.keys(lv[2]).forEach(function (b) { parent[lv[2][b]] = i; }); });
    root.fxReveal = function (name) {
      for (var i = 0; i < levels.length; i++) {
        if (levels[i][1].indexOf(name) < 0) continue;
        var path = [];
        for (var at = i; at !== undefined; at = parent[at]) path.unshift(at);
        path.forEach(function (index, depth) { open(index, depth); });
        return true;
      }
      return false;
    };
    open(0, 0);
  }
  document.querySelectorAll(".fx-outline").forEach(outline);

  // --- search: highlight every node whose name/op/target matches, pan to one at a time ---
  var box = document.getElementById("fx-search");
  var count = document.getElementById("fx-search-count");
  var matches = [], current = -1;

  function words(node) { // the label's first lines: name, op, target (cut at 60 characters)
    var texts = node.querySelectorAll("text"), out = [];
    for (var i = 0; i < Math.min(texts.length, 3); i++) out.push(texts[i].textContent.trim().toLowerCase());
    if (out[1] === "placeholder" || out[1] === "output") out.length = 2; // line 3: not a target
    return out;
  }
  function drawn(q) { // whether a drawn node's name, op or target contains q
    return [].some.call(document.querySelectorAll(".fx-zoom g.node:not(.fx_legend)"), function (n) {
      return words(n).some(function (x) { return x.indexOf(q) >= 0; });
    });
  }
  function search(query, revealed) {
    matches.forEach(function (n) { n.classList.remove("fx-match", "fx-current"); });
    matches = []; current = -1;
    var q = query.trim().toLowerCase();
    if (q && !revealed && !drawn(q)) { // a node of a module not open: open it, then look again
      var opened = [].some.call(document.querySelectorAll(".fx-outline"), function (o) { return o.fxReveal(query.trim()); });
      if (opened) return search(query, true);
    }
    if (q) {
      var exact = [], partial = [];
      document.querySelectorAll(".fx-zoom g.node:not(.fx_legend)").forEach(function (n) {
        var w = words(n);
        if (!w.some(function (x) { return x.indexOf(q) >= 0; })) return;
        n.classList.add("fx-match");
        (w[0] === q ? exact : partial).push(n);
      });
      matches = exact.concat(partial); // a node named exactly so comes first
    }
    count.textContent = q ? (matches.length ? "1 of " + matches.length : "no match") : "";
    if (matches.length) show(0);
    return matches.length;
  }
  function show(i) {
    if (!matches.length) return;
    if (current >= 0) matches[current].classList.remove("fx-current");
    current = (i + matches.length) % matches.length;
    var node = matches[current];
    node.classList.add("fx-current");
    count.textContent = (current + 1) + " of " + matches.length;
    var details = node.closest("details");
    if (details) details.open = true;
    var figure = node.closest(".fx-zoom");
    figure.scrollIntoView({block: "center"});
    var pz = panZoom(figure);
    if (!pz) return; // not laid out: it opens on the drawing's own view once it is
    if (pz.getSizes().realZoom < 1) setRealZoom(pz, 1); // readable: 1 px per SVG unit
    centreOn(figure, boxOf(figure, node));
  }
  box.addEventListener("input", function () { search(box.value); });
  box.addEventListener("keydown", function (e) {
    if (e.key === "Enter") { e.preventDefault(); show(current + (e.shiftKey ? -1 : 1)); }
    if (e.key === "Escape") { box.value = ""; search(""); box.blur(); }
  });

  // --- pass navigation: the sidebar marks where you are; prev/next jump between changes ---
  var passes = Array.prototype.slice.call(document.querySelectorAll("main > section"));
  var links = new Map();
  document.querySelectorAll("#fx-toc a[href^='#']").forEach(function (a) {
    links.set(a.getAttribute("href").slice(1), a);
  });
  function here() { // the last section whose top has scrolled past the top of the window
    var at = 0;
    passes.forEach(function (s, i) { if (s.getBoundingClientRect().top <= 80) at = i; });
    return at;
  }
  function jump(step) {
    var from = here();
    for (var i = from + step; i >= 0 && i < passes.length; i += step) {
      if (passes[i].classList.contains("fx-changed")) {
        passes[i].scrollIntoView({block: "start"});
        return passes[i].id;
      }
    }
    return null;
  }
  var marked = null, pending = false;
  function mark() {
    pending = false;
    var link = passes.length ? links.get(passes[here()].id) : null;
    if (link === marked) return;
    if (marked) marked.classList.remove("fx-here");
    if (link) { link.classList.add("fx-here"); link.scrollIntoView({block: "nearest"}); }
    marked = link;
  }
  window.addEventListener("scroll", function () {
    if (!pending) { pending = true; requestAnimationFrame(mark); }
  });
  mark();
  document.getElementById("fx-prev").addEventListener("click", function () { jump(-1); });
  document.getElementById("fx-next").addEventListener("click", function () { jump(1); });
  document.addEventListener("keydown", function (e) {
    if (e.target === box || e.ctrlKey || e.metaKey || e.altKey) return;
    if (e.key === "n") jump(1);
    else if (e.key === "p") jump(-1);
    else if (e.key === "/") { e.preventDefault(); box.focus(); box.select(); }
    else if (e.key === "f") { var f = figureInView(); if (f) toggleWhole(f); }
  });

  // what tests and the curious can drive from the console
  window.fxReport = {panZoom: panZoom, search: search, show: show, jump: jump, toggleWhole: toggleWhole,
                     matches: function () { return matches.slice(); }};
})();
