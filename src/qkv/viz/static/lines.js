/* qkv attention explorer: query tokens on the left, key tokens on the right, one line per weight
 * (lines.js). Used by the head view, the rollout view and the compare view.
 *
 * A spec is { queries: [str], keys: [str], matrices: [{ head, color, weights: [s_q][s_k] }],
 * emphasis: { query: [bool], key: [bool] } (optional: bold tokens, the others muted),
 * onFocus(side, index) (optional: called when the pointer focuses a token) }.
 * Up to MAX_SVG_LINES lines are SVG <line> elements; more (long inputs: a 512-token sentence
 * draws tens of thousands) are painted on a canvas between the token labels, grouped by colour and
 * opacity so one stroke paints many lines, and only where they cross the part of the (scrolling)
 * drawing in view, repainted as it scrolls. Hovering a token keeps only its lines and shades the
 * tokens on the other side by its mean weight over the matrices. Longer inputs (over Q.LONG_ROWS
 * tokens a side, or a long input's reduced weights) are drawn by longlines.js, rows in view only. */
(function (Q) {
  "use strict";

  /* lines lighter than 0.01 are not drawn; as a float32 (the page's unpacked weights, core.js) so a
   * weight of exactly 0.01 in the JSON, 0.00999999977648 in a Float32Array, is drawn too */
  var MIN_WEIGHT = Math.fround(0.01);
  var GAP = 260; // horizontal span of the lines
  var MAX_SVG_LINES = 4000;
  var OPACITY_LEVELS = 64; // canvas lines: weights rounded to this many opacities
  var SHADE = "#2458b3";
  var MUTED = "#8a939c";
  var INK = "#1d232a";

  Q.MIN_WEIGHT = MIN_WEIGHT;

  function layout(spec) {
    var rows = Math.max(spec.queries.length, spec.keys.length);
    var dense = rows > 60;
    var font = dense ? 11 : 13;
    var row = dense ? 15 : 22;
    var labelWidth = function (tokens) {
      var widest = tokens.reduce(function (m, t) { return Math.max(m, Q.textWidth(t, font)); }, 8);
      return Math.min(220, Math.ceil(widest) + 16);
    };
    var left = labelWidth(spec.queries);
    var right = labelWidth(spec.keys);
    return {
      font: font, row: row, line: dense ? 1 : 2, left: left, right: right, width: left + GAP + right, height: row * rows + 16,
      y: function (i) { return 8 + row * i + row / 2; }
    };
  }

  function countLines(spec) {
    var n = 0;
    spec.matrices.forEach(function (m) {
      m.weights.forEach(function (row) {
        for (var k = 0; k < row.length; k++) { if (row[k] >= MIN_WEIGHT) { n += 1; } }
      });
    });
    return n;
  }

  function visible(focus, q, k) {
    return !focus || (focus.side === "query" ? q === focus.index : k === focus.index);
  }

  /* Shades of the query and key labels for a focus: the focused token 0.25, the other side its
   * mean weight over the matrices. */
  function shades(spec, focus) {
    var out = { query: spec.queries.map(function () { return 0; }), key: spec.keys.map(function () { return 0; }) };
    if (!focus) { return out; }
    var n = spec.matrices.length;
    out[focus.side][focus.index] = 0.25;
    if (!n) { return out; }
    var other = focus.side === "query" ? "key" : "query";
    out[other] = out[other].map(function (_, j) {
      var sum = 0;
      spec.matrices.forEach(function (m) {
        sum += focus.side === "query" ? m.weights[focus.index][j] : m.weights[j][focus.index];
      });
      return sum / n;
    });
    return out;
  }

  /* The drawing as a Q.Figure; lines only with `withLines` (an on-screen canvas paints them). */
  function figure(spec, focus, withLines) {
    var L = layout(spec);
    var fig = new Q.Figure(L.width, L.height);
    if (withLines) {
      var lines = fig.group({ "class": "lines", batched: countLines(spec) > MAX_SVG_LINES });
      spec.matrices.forEach(function (m) {
        m.weights.forEach(function (row, q) {
          for (var k = 0; k < row.length; k++) {
            var w = row[k];
            if (w < MIN_WEIGHT || !visible(focus, q, k)) { continue; }
            lines.line({
              x1: L.left, y1: L.y(q), x2: L.left + GAP, y2: L.y(k), stroke: m.color, "stroke-width": L.line,
              "stroke-opacity": w.toFixed(4), "stroke-linecap": "round", "data-head": m.head, "data-q": q, "data-k": k
            });
          }
        });
      });
    }
    var shade = shades(spec, focus);
    tokens(fig, spec, "query", 0, L.left, L, shade.query);
    tokens(fig, spec, "key", L.left + GAP, L.right, L, shade.key);
    return fig;
  }

  function tokens(fig, spec, side, x0, width, L, shade) {
    var group = fig.group({ "class": side === "query" ? "queries" : "keys" });
    var strong = spec.emphasis ? spec.emphasis[side] : null;
    (side === "query" ? spec.queries : spec.keys).forEach(function (token, i) {
      group.rect({
        "class": "weight", x: x0 + 2, y: L.y(i) - L.row / 2 + 2, width: width - 4, height: L.row - 4,
        fill: SHADE, "fill-opacity": shade[i].toFixed(3), "data-index": i, "data-side": side
      });
      group.text({
        "class": "token " + side, x: side === "query" ? x0 + width - 6 : x0 + 6, y: L.y(i), text: token,
        "text-anchor": side === "query" ? "end" : "start", "dominant-baseline": "middle", "font-size": L.font,
        fill: strong && !strong[i] ? MUTED : INK, "font-weight": strong && strong[i] ? "bold" : null,
        "data-index": i, "data-side": side
      });
    });
  }

  /* The part of the drawing in view: a long input's .lines-host scrolls, and only the lines that
   * cross its visible height are painted (on a canvas of that height, moved with the scroll). */
  function visibleRows(host, L) {
    if (host.scrollHeight > host.clientHeight + 1) {
      return { top: host.scrollTop, height: Math.min(host.clientHeight, L.height - host.scrollTop) };
    }
    return { top: 0, height: L.height };
  }

  function paintLines(canvas, spec, L, focus) {
    var ratio = window.devicePixelRatio || 1;
    var shown = visibleRows(canvas.parentNode, L);
    var top = shown.top, bottom = shown.top + shown.height;
    canvas.width = Math.ceil(GAP * ratio);
    canvas.height = Math.ceil(shown.height * ratio);
    canvas.style.width = GAP + "px";
    canvas.style.height = shown.height + "px";
    canvas.style.left = L.left + "px";
    canvas.style.top = top + "px";
    var ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.translate(0, -top);
    ctx.lineWidth = L.line;
    ctx.lineCap = "round";
    spec.matrices.forEach(function (m) {
      var paths = [];
      var add = function (q, k, w) {
        if (w < MIN_WEIGHT) { return; }
        var yq = L.y(q), yk = L.y(k);
        if ((yq < top && yk < top) || (yq > bottom && yk > bottom)) { return; }
        var level = Math.min(OPACITY_LEVELS - 1, Math.floor(w * OPACITY_LEVELS));
        var path = paths[level] || (paths[level] = new Path2D());
        path.moveTo(0, yq);
        path.lineTo(GAP, yk);
      };
      if (focus && focus.side === "query") {
        m.weights[focus.index].forEach(function (w, k) { add(focus.index, k, w); });
      } else if (focus) {
        m.weights.forEach(function (row, q) { add(q, focus.index, row[focus.index]); });
      } else {
        m.weights.forEach(function (row, q) { for (var k = 0; k < row.length; k++) { add(q, k, row[k]); } });
      }
      ctx.strokeStyle = m.color;
      paths.forEach(function (path, level) {
        ctx.globalAlpha = (level + 0.5) / OPACITY_LEVELS;
        ctx.stroke(path);
      });
    });
  }

  /* Draw `spec` into `svg` (whose parent is a .lines-host). Returns the number of lines. */
  Q.drawTokenLines = function (svg, spec) {
    var long = spec.matrices.some(function (m) { return m.sparse; }) ||
      Math.max(spec.queries.length, spec.keys.length) > Q.LONG_ROWS;
    if (long) { return Q.drawLongLines(svg, spec); } // longlines.js: only the rows in view
    svg.parentNode.classList.remove("long");
    svg.onmousemove = null;
    var L = layout(spec);
    var count = countLines(spec);
    var onCanvas = count > MAX_SVG_LINES;
    figure(spec, null, !onCanvas).toSVG(svg);
    svg.dataset.lines = String(count);
    svg.dataset.mode = onCanvas ? "canvas" : "svg";
    svg.qkvLines = { spec: spec, layout: L, focus: null };
    var host = svg.parentNode;
    host.classList.toggle("dense", L.row < 22);
    var canvas = host.querySelector("canvas.lines-canvas");
    if (onCanvas) {
      if (!canvas) { canvas = Q.html("canvas", { "class": "lines-canvas" }, host); }
      paintLines(canvas, spec, L, null);
    } else if (canvas) {
      host.removeChild(canvas);
    }
    var pending = false;
    host.onscroll = function () {
      if (pending || svg.dataset.mode !== "canvas") { return; }
      pending = true;
      requestAnimationFrame(function () {
        pending = false;
        var c = host.querySelector("canvas.lines-canvas");
        if (c && svg.qkvLines) { paintLines(c, svg.qkvLines.spec, svg.qkvLines.layout, svg.qkvLines.focus); }
      });
    };
    svg.onmouseover = function (event) {
      var index = event.target.dataset ? event.target.dataset.index : undefined;
      if (index === undefined) { Q.focusTokenLines(svg, null, -1, true); return; }
      Q.focusTokenLines(svg, event.target.dataset.side, Number(index), true);
    };
    svg.onmouseleave = function () { Q.focusTokenLines(svg, null, -1, true); };
    return count;
  };

  /* Focus a token (side "query" or "key", or null for none): only its lines, the other side shaded. */
  Q.focusTokenLines = function (svg, side, index, byUser) {
    var drawn = svg.qkvLines;
    if (!drawn) { return; }
    var focus = side === null ? null : { side: side, index: index };
    var old = drawn.focus;
    if ((!old && !focus) || (old && focus && old.side === focus.side && old.index === focus.index)) { return; }
    drawn.focus = focus;
    if (drawn.long) {
      Q.focusLongLines(svg, focus);
      if (byUser && drawn.spec.onFocus) { drawn.spec.onFocus(side, index); }
      return;
    }
    if (svg.dataset.mode === "canvas") {
      paintLines(svg.parentNode.querySelector("canvas.lines-canvas"), drawn.spec, drawn.layout, focus);
    } else {
      Array.prototype.forEach.call(svg.querySelectorAll("line"), function (line) {
        line.classList.toggle("hidden", !visible(focus, Number(line.dataset.q), Number(line.dataset.k)));
      });
    }
    var shade = shades(drawn.spec, focus);
    Array.prototype.forEach.call(svg.querySelectorAll("rect.weight"), function (rect) {
      rect.setAttribute("fill-opacity", shade[rect.dataset.side][Number(rect.dataset.index)].toFixed(3));
    });
    if (byUser && drawn.spec.onFocus) { drawn.spec.onFocus(side, index); }
  };

  /* What `svg` shows now (lines, focus and shading) as a Q.Figure, for Save PNG / Save SVG. */
  Q.tokenLinesFigure = function (svg) {
    var drawn = svg.qkvLines;
    if (drawn.long) { return Q.longLinesFigure(svg); }
    return figure(drawn.spec, drawn.focus, true);
  };
})(window.qkvExplorer);
