// fxopt report glue: zoom/pan (svg-pan-zoom does the work), node search, pass navigation.
// Inlined into the page after svg-pan-zoom; no network, no other library.
(function () {
  "use strict";
  var instances = new Map(); // figure element -> svg-pan-zoom instance

  // --- zoom and pan: one svg-pan-zoom per figure, created when it is first visible ---
  function panZoom(figure) {
    if (instances.has(figure)) return instances.get(figure);
    var svg = figure.querySelector("svg");
    svg.setAttribute("width", "100%");
    svg.setAttribute("height", "100%");
    var pz = svgPanZoom(svg, {
      controlIconsEnabled: true, zoomScaleSensitivity: 0.3, minZoom: 0.2, maxZoom: 60,
      fit: true, center: true, dblClickZoomEnabled: false
    });
    var s = pz.getSizes();
    if (s.realZoom < 0.4) { // a tall graph shrunk to a speck: start at its top, width-fitted
      pz.zoom(Math.min(1, s.width / s.viewBox.width) / (s.realZoom / pz.getZoom()));
      s = pz.getSizes();
      pz.pan({x: (s.width - s.viewBox.width * s.realZoom) / 2, y: 8});
    }
    instances.set(figure, pz);
    return pz;
  }
  var figures = document.querySelectorAll(".fx-zoom");
  var observer = new IntersectionObserver(function (entries) {
    entries.forEach(function (e) {
      if (e.isIntersecting) { panZoom(e.target); observer.unobserve(e.target); }
    });
  });
  figures.forEach(function (f) { observer.observe(f); });

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
  function search(query) {
    matches.forEach(function (n) { n.classList.remove("fx-match", "fx-current"); });
    matches = []; current = -1;
    var q = query.trim().toLowerCase();
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
    var s = pz.getSizes();
    if (s.realZoom < 1) pz.zoom(pz.getZoom() / s.realZoom); // readable: 1 px per SVG unit
    // the node's centre in the coordinates svg-pan-zoom scales and pans (the DOM's transform
    // lags a frame behind its API, so positions on screen cannot be used)
    var viewport = figure.querySelector(".svg-pan-zoom_viewport");
    var bb = node.getBBox(), point = figure.querySelector("svg").createSVGPoint();
    point.x = bb.x + bb.width / 2; point.y = bb.y + bb.height / 2;
    point = point.matrixTransform(viewport.getCTM().inverse().multiply(node.getCTM()));
    s = pz.getSizes();
    pz.pan({x: s.width / 2 - s.realZoom * point.x, y: s.height / 2 - s.realZoom * point.y});
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
  });

  // what tests and the curious can drive from the console
  window.fxReport = {panZoom: panZoom, search: search, show: show, jump: jump,
                     matches: function () { return matches.slice(); }};
})();
