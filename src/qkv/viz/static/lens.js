/* qkv attention explorer: the logit lens (lens.js). example.lens holds, for every depth (the
 * embeddings, then the output of each layer; the last is the model's own output) and every
 * position, the k most likely next tokens when the final norm and the output projection are applied
 * to that depth's hidden state (lens.py). The grid shows each depth (rows) x position (columns) as
 * its most likely token, shaded by its probability, a window of WINDOW positions at a time; a cell
 * outlined is one whose token is the one that came next. Clicking a cell lists that depth's k tokens
 * and, beside them, the model's candidate tokens at that position (the last depth's). A long text's
 * lens covers its last positions: lens.first is the first one's index in the text, as numbered here. */
(function (Q) {
  "use strict";

  var WINDOW = 16, CELL_W = 74, CELL_H = 24, LABEL_W = 92, TOP = 40, FONT = 12;
  var COLOR = "#2458b3", MATCH = "#e8590c", BAR_W = 220, BAR_H = 18, LIST_W = 440;

  Q.state.lens = { example: -1, layer: 0, position: 0 };

  function lens() { return Q.currentExample().lens; }

  /* A probability as the page writes it: 3 decimals, or 2 significant digits below 0.001. */
  Q.formatProb = function (p) { return p >= 0.001 || p === 0 ? p.toFixed(3) : p.toExponential(1); };

  function clip(text, width) {
    if (Q.textWidth(text, FONT) <= width) { return text; }
    while (text.length > 1 && Q.textWidth(text + "\u2026", FONT) > width) { text = text.slice(0, -1); }
    return text + "\u2026";
  }

  function syncState(l) {
    var st = Q.state.lens;
    if (st.example !== Q.state.example) {  // a new sentence: its last position, at the model's output
      st.example = Q.state.example;
      st.layer = l.layers.length - 1;
      st.position = l.positions.length - 1;
    }
    st.layer = Math.min(st.layer, l.layers.length - 1);
    st.position = Math.min(st.position, l.positions.length - 1);
    return st;
  }

  function windowStart(position) { return Math.floor(position / WINDOW) * WINDOW; }

  function grid(fig, l, st) {
    var start = windowStart(st.position), end = Math.min(l.positions.length, start + WINDOW);
    var g = fig.group({ dx: 0, dy: 0, "class": "lens-grid" });
    g.text({ x: 0, y: 12, text: "input", "font-size": 11, fill: "#66707a" });
    for (var i = start; i < end; i++) {
      var x = LABEL_W + (i - start) * CELL_W;
      g.text({ "class": "lens-position", x: x + CELL_W / 2, y: 12, text: clip(l.positions[i], CELL_W - 4),
               "font-size": FONT, "text-anchor": "middle", fill: "#1d232a", "data-position": i });
      g.text({ x: x + CELL_W / 2, y: 28, text: String(l.first + i), "font-size": 10, "text-anchor": "middle",
               fill: "#66707a" });
    }
    l.layers.forEach(function (name, layer) {
      var y = TOP + layer * CELL_H;
      g.text({ x: 0, y: y + CELL_H / 2, text: layer === l.layers.length - 1 ? name + " (output)" : name,
               "font-size": 11, "dominant-baseline": "middle", fill: "#1d232a" });
      for (var i = start; i < end; i++) {
        var x = LABEL_W + (i - start) * CELL_W, p = l.probs[layer][i][0];
        var token = l.vocabulary[l.top[layer][i][0]];
        var match = l.next[i] !== null && token === l.next[i];
        var chosen = layer === st.layer && i === st.position;
        g.rect({ "class": "lens-cell", x: x + 1, y: y + 1, width: CELL_W - 2, height: CELL_H - 2, rx: 3, fill: COLOR,
                 "fill-opacity": Q.opacity(p), stroke: chosen ? "#1d232a" : match ? MATCH : "#d9dee3",
                 "stroke-width": chosen || match ? 2 : 1, "data-layer": layer, "data-position": i,
                 "data-token": token, "data-prob": p, "data-match": match ? "1" : "0",
                 title: name + ", position " + (l.first + i) + ": " + token + " " + Q.formatProb(p) });
        g.text({ x: x + CELL_W / 2, y: y + CELL_H / 2, text: clip(token, CELL_W - 8), "font-size": FONT,
                 "text-anchor": "middle", "dominant-baseline": "middle", fill: p > 0.6 ? "#ffffff" : "#1d232a",
                 "pointer-events": "none" });
      }
    });
    var y = TOP + l.layers.length * CELL_H + 14;
    g.text({ x: 0, y: y, text: "came next", "font-size": 11, fill: "#66707a", "dominant-baseline": "middle" });
    for (var j = start; j < end; j++) {
      g.text({ "class": "lens-next", x: LABEL_W + (j - start) * CELL_W + CELL_W / 2, y: y,
               text: l.next[j] === null ? "\u2014" : clip(l.next[j], CELL_W - 4), "font-size": FONT,
               "text-anchor": "middle", "dominant-baseline": "middle", fill: MATCH, "data-position": j });
    }
    return y + 16;
  }

  /* Bars of one depth's k tokens at a position, under a title. */
  function bars(g, l, layer, position, kind, title) {
    g.text({ x: 0, y: 12, text: title, "font-size": 13, "font-weight": "bold", fill: "#1d232a" });
    var y = 24;
    l.top[layer][position].forEach(function (index, r) {
      var token = l.vocabulary[index], p = l.probs[layer][position][r];
      g.text({ x: 0, y: y + BAR_H / 2, text: clip(token, 120), "font-size": FONT, "dominant-baseline": "middle",
               fill: "#1d232a" });
      g.rect({ "class": kind, x: 128, y: y + 2, width: Math.max(1, BAR_W * p), height: BAR_H - 4, fill: COLOR,
               "data-rank": r, "data-token": token, "data-prob": p });
      g.text({ "class": kind + "-value", x: 128 + BAR_W + 6, y: y + BAR_H / 2, text: Q.formatProb(p), "font-size": FONT,
               "dominant-baseline": "middle", fill: "#1d232a" });
      y += BAR_H;
    });
    if (l.next[position] !== null) {
      g.text({ "class": kind + "-next", x: 0, y: y + BAR_H / 2 + 4, "font-size": 11, "dominant-baseline": "middle",
               fill: MATCH, text: "came next: " + l.next[position] + " " + Q.formatProb(l.next_probs[layer][position]) });
      y += BAR_H;
    }
    return y + 8;
  }

  function lensFigure() {
    var l = lens(), st = syncState(l);
    var width = Math.max(LABEL_W + Math.min(WINDOW, l.positions.length) * CELL_W, 2 * LIST_W);
    var fig = new Q.Figure(width, 0);
    var bottom = grid(fig, l, st) + 12;
    var last = l.layers.length - 1;
    var where = "position " + (l.first + st.position) + " (\u201c" + l.positions[st.position] + "\u201d)";
    var left = fig.group({ dx: 0, dy: bottom, "class": "lens-layer" });
    var right = fig.group({ dx: LIST_W, dy: bottom, "class": "lens-candidates" });
    var h = Math.max(bars(left, l, st.layer, st.position, "lens-bar", l.layers[st.layer] + " at " + where),
                     bars(right, l, last, st.position, "candidate-bar", "candidates at " + where));
    fig.height = Math.ceil(bottom + h);
    return fig;
  }

  function drawWindows(l, st) {
    var select = Q.$("lens-window"), n = l.positions.length;
    Q.$("lens-window-label").hidden = n <= WINDOW;
    var key = Q.state.example + ":" + n;
    if (select.dataset.key !== key) {
      var labels = [];
      for (var s = 0; s < n; s += WINDOW) {
        labels.push((l.first + s) + "\u2013" + (l.first + Math.min(n, s + WINDOW) - 1));
      }
      Q.setOptions(select, labels, 0);
      select.dataset.key = key;
    }
    select.value = String(windowStart(st.position) / WINDOW);
  }

  function draw() {
    var l = lens(), st = syncState(l);
    Q.$("lens-about").textContent = "what each layer's hidden state predicts as " + l.about +
      " (the final norm and the output projection applied to it); click a cell";
    drawWindows(l, st);
    var svg = Q.$("lens-svg");
    lensFigure().toSVG(svg);
    Array.prototype.forEach.call(svg.querySelectorAll("rect.lens-cell"), function (cell) {
      cell.style.cursor = "pointer";
      cell.addEventListener("click", function () {
        st.layer = Number(cell.dataset.layer);
        st.position = Number(cell.dataset.position);
        Q.render();
      });
    });
  }

  function wire() {
    Q.$("lens-window").addEventListener("change", function (e) {
      var l = lens(), st = syncState(l);
      st.position = Math.min(l.positions.length - 1, Number(e.target.value) * WINDOW + (st.position % WINDOW));
      Q.render();
    });
  }

  wire();
  Q.register({
    id: "lens",
    available: function () { return Boolean(lens()); },
    draw: draw,
    figures: {
      lens: function () {
        return Q.titled(lensFigure(), "logit lens of \u201c" + Q.currentExample().text + "\u201d (" + lens().about + ")");
      }
    }
  });
})(window.qkvExplorer);
