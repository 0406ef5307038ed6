/* qkv attention explorer: the line drawing for long inputs (longlines.js), used by lines.js's
 * Q.drawTokenLines for more than LONG_ROWS tokens a side or for a long input's reduced weights.
 *
 * Nothing is drawn for the rows out of view: the <svg> is an empty box of the drawing's full height
 * that makes its .lines-host scroll, and one canvas of the visible height, moved with the scroll,
 * paints the token labels of the rows in view and the lines that cross it. A matrix is either every
 * weight ({ weights: [s_q][s_k] }) or a query's K largest ({ sparse: { k, index, weight } }, see
 * Q.matrixOf in core.js): lines are then drawn for those K only (of 0.01 or more), which the head
 * view's caption says. Hovering a token (found from the pointer's position) keeps only its lines and
 * shades the other side by its mean weight over the matrices (from the weights the page holds). */
(function (Q) {
  "use strict";

  var GAP = 260, ROW = 15, FONT = 11, PAD = 8, OPACITY_LEVELS = 64;
  var SHADE = "#2458b3", MUTED = "#8a939c", INK = "#1d232a";

  Q.LONG_ROWS = 1024; // more tokens a side than this: drawn here

  function layout(spec) {
    var rows = Math.max(spec.queries.length, spec.keys.length);
    var width = function (tokens) {
      var widest = 8;
      for (var i = 0; i < tokens.length; i++) { widest = Math.max(widest, Q.textWidth(tokens[i], FONT)); }
      return Math.min(220, Math.ceil(widest) + 16);
    };
    var left = width(spec.queries), right = width(spec.keys);
    return { rows: rows, left: left, right: right, width: left + GAP + right, height: ROW * rows + 2 * PAD,
             y: function (i) { return PAD + ROW * i + ROW / 2; } };
  }

  /* Call fn(q, k, w) for each weight of matrix m of 0.01 or more, with the focus if any. */
  function eachLine(m, focus, fn) {
    var min = Q.MIN_WEIGHT;
    if (m.sparse) {
      var K = m.sparse.k, index = m.sparse.index, weight = m.sparse.weight, rows = index.length / K;
      var from = focus && focus.side === "query" ? focus.index : 0;
      var to = focus && focus.side === "query" ? focus.index + 1 : rows;
      for (var q = from; q < to; q++) {
        for (var j = q * K; j < q * K + K; j++) {
          var w = weight[j];
          if (w < min) { break; } // largest first
          if (focus && focus.side === "key" && index[j] !== focus.index) { continue; }
          fn(q, index[j], w);
        }
      }
      return;
    }
    m.weights.forEach(function (row, q) {
      if (focus && focus.side === "query" && q !== focus.index) { return; }
      for (var k = 0; k < row.length; k++) {
        if (row[k] < min || (focus && focus.side === "key" && k !== focus.index)) { continue; }
        fn(q, k, row[k]);
      }
    });
  }

  function countLines(spec) {
    var n = 0;
    spec.matrices.forEach(function (m) { eachLine(m, null, function () { n += 1; }); });
    return n;
  }

  /* The shades of the query and key labels for a focus (as lines.js: the token 0.25, the other
   * side its mean weight over the matrices). */
  function shades(spec, focus) {
    var out = { query: new Float32Array(spec.queries.length), key: new Float32Array(spec.keys.length) };
    if (!focus) { return out; }
    var n = spec.matrices.length, other = focus.side === "query" ? "key" : "query";
    out[focus.side][focus.index] = 0.25;
    spec.matrices.forEach(function (m) {
      eachLine(m, focus, function (q, k, w) { out[other][other === "key" ? k : q] += w / n; });
    });
    return out;
  }

  /* The rows in view: the scroll position's first and last token, and the window's top and height. */
  function shown(host, L) {
    var top = host.scrollTop, height = Math.max(1, Math.min(host.clientHeight || L.height, L.height - top));
    return { top: top, height: height, first: Math.max(0, Math.floor((top - PAD) / ROW)),
             last: Math.min(L.rows - 1, Math.ceil((top + height - PAD) / ROW)) };
  }

  /* The window's labels and lines as a Q.Figure (drawn at y - top); the canvas paints the same. */
  function windowFigure(drawn, win) {
    var spec = drawn.spec, L = drawn.layout, focus = drawn.focus, top = win.top;
    var fig = new Q.Figure(L.width, win.height);
    var lines = fig.group({ "class": "lines", batched: true });
    spec.matrices.forEach(function (m) {
      eachLine(m, focus, function (q, k, w) {
        var yq = L.y(q) - top, yk = L.y(k) - top;
        if ((yq < 0 && yk < 0) || (yq > win.height && yk > win.height)) { return; }
        lines.line({ x1: L.left, y1: yq, x2: L.left + GAP, y2: yk, stroke: m.color, "stroke-width": 1,
                     "stroke-opacity": w.toFixed(4), "stroke-linecap": "round" });
      });
    });
    ["query", "key"].forEach(function (side) {
      var tokens = side === "query" ? spec.queries : spec.keys, x0 = side === "query" ? 0 : L.left + GAP;
      var width = side === "query" ? L.left : L.right, strong = spec.emphasis ? spec.emphasis[side] : null;
      for (var i = win.first; i <= Math.min(win.last, tokens.length - 1); i++) {
        var y = L.y(i) - top, shade = drawn.shades[side][i];
        if (shade > 0) {
          fig.rect({ x: x0 + 2, y: y - ROW / 2 + 2, width: width - 4, height: ROW - 4, fill: SHADE,
                     "fill-opacity": Math.min(1, shade).toFixed(3) });
        }
        fig.text({ x: side === "query" ? x0 + width - 6 : x0 + 6, y: y, text: tokens[i], "font-size": FONT,
                   "text-anchor": side === "query" ? "end" : "start", "dominant-baseline": "middle",
                   fill: strong && !strong[i] ? MUTED : INK, "font-weight": strong && strong[i] ? "bold" : null });
      }
    });
    return fig;
  }

  function paint(svg) {
    var drawn = svg.qkvLines, host = svg.parentNode, L = drawn.layout;
    var win = shown(host, L), ratio = window.devicePixelRatio || 1;
    var canvas = host.querySelector("canvas.lines-canvas") || Q.html("canvas", { "class": "lines-canvas" }, host);
    canvas.width = Math.ceil(L.width * ratio);
    canvas.height = Math.ceil(win.height * ratio);
    canvas.style.width = L.width + "px";
    canvas.style.height = win.height + "px";
    canvas.style.left = "0px";
    canvas.style.top = win.top + "px";
    canvas.getContext("2d").drawImage(windowFigure(drawn, win).toCanvas(ratio), 0, 0);
    svg.dataset.firstRow = String(win.first);
    svg.dataset.lastRow = String(win.last);
    drawn.window = win;
    if (drawn.spec.onWindow) { drawn.spec.onWindow(win); }
  }

  /* Draw `spec` (see lines.js) into `svg`, whose parent is a .lines-host. Returns the number of lines. */
  Q.drawLongLines = function (svg, spec) {
    var L = layout(spec), host = svg.parentNode, count = countLines(spec);
    svg.textContent = "";
    svg.setAttribute("width", String(L.width));
    svg.setAttribute("height", String(L.height));
    svg.removeAttribute("viewBox");
    svg.dataset.lines = String(count);
    svg.dataset.mode = "virtual";
    host.classList.add("dense");
    host.classList.add("long");
    svg.qkvLines = { spec: spec, layout: L, focus: null, shades: shades(spec, null), long: true };
    paint(svg);
    var pending = false;
    host.onscroll = function () {
      if (pending) { return; }
      pending = true;
      requestAnimationFrame(function () { pending = false; if (svg.dataset.mode === "virtual") { paint(svg); } });
    };
    svg.onmouseover = null;
    svg.onmousemove = function (event) {
      var box = svg.getBoundingClientRect(), x = event.clientX - box.left, y = event.clientY - box.top;
      var index = Math.floor((y - PAD) / ROW);
      var side = x < L.left ? "query" : x > L.left + GAP ? "key" : null;
      var n = side === "query" ? spec.queries.length : spec.keys.length;
      if (side === null || index < 0 || index >= n) { Q.focusTokenLines(svg, null, -1, true); return; }
      Q.focusTokenLines(svg, side, index, true);
    };
    svg.onmouseleave = function () { Q.focusTokenLines(svg, null, -1, true); };
    return count;
  };

  /* lines.js's Q.focusTokenLines for a long drawing: repaint with the focus. */
  Q.focusLongLines = function (svg, focus) {
    svg.qkvLines.focus = focus;
    svg.qkvLines.shades = shades(svg.qkvLines.spec, focus);
    paint(svg);
  };

  /* Scroll the drawing so that row `row` is in the middle of the view. */
  Q.scrollLinesTo = function (svg, row) {
    var host = svg.parentNode, L = svg.qkvLines.layout;
    host.scrollTop = Math.max(0, L.y(row) - host.clientHeight / 2);
    paint(svg);
  };

  /* What a long drawing shows now (the rows in view) as a Q.Figure, for Save PNG / Save SVG. */
  Q.longLinesFigure = function (svg) {
    var drawn = svg.qkvLines;
    return windowFigure(drawn, drawn.window || shown(svg.parentNode, drawn.layout));
  };
})(window.qkvExplorer);
