/* qkv attention explorer: the head summary (summary.js). One layers x heads heatmap per statistic
 * of view.stats (or, with the corpus toggle, data.corpus.views[view name].stats), and a grid of the
 * heads' labels (view.labels). A cell's opacity is its value: fractions of attention (previous,
 * same, next, delimiter) as they are, the others (entropy, distance, ...) divided by the largest
 * value of their grid. Clicking a cell opens that layer and head in the head view. */
(function (Q) {
  "use strict";

  var FRACTIONS = { previous: true, same: true, next: true, delimiter: true };
  var TITLES = {
    entropy: "entropy (nats)", previous: "attention to the previous token", same: "attention to the token itself",
    next: "attention to the next token", delimiter: "attention to delimiters", distance: "mean attended distance"
  };
  var COLORS = { entropy: "#c2570c", distance: "#2f7d32" };
  var LABELS = {
    "previous-token head": { short: "prev", color: "#7048e8" },
    "same-token head": { short: "same", color: "#1971c2" },
    "next-token head": { short: "next", color: "#0c8599" },
    "delimiter head": { short: "delim", color: "#e8590c" },
    "broad head": { short: "broad", color: "#868e96" }
  };
  var CW = 38, CH = 22, AXIS = 30, TOP = 40, PANEL_GAP = 28, WIDTH = 1240;

  /* The stats and labels shown now, and where they come from. */
  function source() {
    var view = Q.currentView();
    var corpus = corpusFor(view);
    var toggle = Q.$("summary-corpus");
    var useCorpus = corpus && (toggle.checked || !view.stats);
    if (useCorpus) {
      return { stats: corpus.stats || {}, labels: corpus.labels || null, layers: view.layers, heads: view.heads,
               note: "averaged over " + Q.data.corpus.sentences + " sentences of " + Q.data.corpus.file };
    }
    return { stats: view.stats || {}, labels: view.labels || null, layers: view.layers, heads: view.heads,
             note: "measured on this sentence" };
  }

  function corpusFor(view) {
    var corpus = Q.data.corpus;
    return corpus && corpus.views && corpus.views[view.name] ? corpus.views[view.name] : null;
  }

  /* The largest value a cell's opacity is divided by. */
  function scaleOf(name, grid) {
    if (FRACTIONS[name]) { return 1; }
    var top = 0;
    grid.forEach(function (row) { row.forEach(function (v) { if (v > top) { top = v; } }); });
    return top > 0 ? top : 1;
  }

  function subtitleOf(name, scale) {
    return FRACTIONS[name] ? "shade: the fraction, 0 to 1" : "shade: value / " + format(scale) + " (the largest)";
  }

  var LABEL_TITLE = "head labels", LABEL_SUBTITLE = "the pattern a head matches best, if one dominates";

  /* A panel's width: its grid, or its title if wider. */
  function panelWidth(src, names) {
    var widest = AXIS + src.heads * CW;
    if (src.labels) {
      widest = Math.max(widest, Q.textWidth(LABEL_TITLE, 13, "bold"), Q.textWidth(LABEL_SUBTITLE, 11));
    }
    names.forEach(function (name) {
      widest = Math.max(widest, Q.textWidth(TITLES[name] || name, 13, "bold"),
                        Q.textWidth(subtitleOf(name, scaleOf(name, src.stats[name])), 11));
    });
    return Math.ceil(widest) + PANEL_GAP;
  }

  function format(v) { return Math.abs(v) >= 10 ? v.toFixed(0) : Math.abs(v) >= 1 ? v.toFixed(1) : v.toFixed(2); }

  function panelFrame(fig, x, y, src, title, subtitle) {
    var g = fig.group({ dx: x, dy: y, "class": "panel" });
    g.text({ x: 0, y: 10, text: title, "font-size": 13, "font-weight": "bold", fill: "#1d232a" });
    g.text({ x: 0, y: 26, text: subtitle, "font-size": 11, fill: "#66707a" });
    Q.range(src.heads).forEach(function (h) {
      g.text({ x: AXIS + h * CW + CW / 2, y: TOP - 6, text: "h" + h, "font-size": 10, fill: "#66707a", "text-anchor": "middle" });
    });
    Q.range(src.layers).forEach(function (l) {
      g.text({ x: AXIS - 6, y: TOP + l * CH + CH / 2, text: "L" + l, "font-size": 10, fill: "#66707a",
               "text-anchor": "end", "dominant-baseline": "middle" });
    });
    return g;
  }

  function labelPanel(fig, x, y, src) {
    var g = panelFrame(fig, x, y, src, LABEL_TITLE, LABEL_SUBTITLE);
    src.labels.forEach(function (row, l) {
      row.forEach(function (label, h) {
        var known = LABELS[label] || null;
        var cx = AXIS + h * CW, cy = TOP + l * CH;
        g.rect({ "class": "label-cell", x: cx + 1, y: cy + 1, width: CW - 2, height: CH - 2, rx: 3,
                 fill: known ? known.color : "#ffffff", "fill-opacity": known ? "0.850" : "1.000",
                 stroke: "#d9dee3", "data-layer": l, "data-head": h, "data-label": label || "",
                 title: "layer " + l + ", head " + h + ": " + (label || "no single pattern") });
        if (label) {
          g.text({ "class": "label-text", x: cx + CW / 2, y: cy + CH / 2, text: known ? known.short : label,
                   "font-size": 10, fill: known ? "#ffffff" : "#1d232a", "text-anchor": "middle",
                   "dominant-baseline": "middle", "pointer-events": "none", "data-layer": l, "data-head": h });
        }
      });
    });
  }

  function statPanel(fig, x, y, src, name) {
    var grid = src.stats[name];
    var scale = scaleOf(name, grid);
    var color = COLORS[name] || "#2458b3";
    var g = panelFrame(fig, x, y, src, TITLES[name] || name, subtitleOf(name, scale));
    grid.forEach(function (row, l) {
      row.forEach(function (v, h) {
        var cx = AXIS + h * CW, cy = TOP + l * CH;
        var opacity = Math.max(0, Math.min(1, v / scale));
        var label = src.labels && src.labels[l] ? src.labels[l][h] : null;
        g.rect({ "class": "cell", x: cx + 1, y: cy + 1, width: CW - 2, height: CH - 2, fill: color,
                 "fill-opacity": opacity.toFixed(3), stroke: "#d9dee3", "data-stat": name, "data-layer": l,
                 "data-head": h, "data-value": v,
                 title: "layer " + l + ", head " + h + ": " + name + " " + v.toFixed(4) + (label ? " (" + label + ")" : "") });
        g.text({ x: cx + CW / 2, y: cy + CH / 2, text: format(v), "font-size": 10,
                 fill: opacity > 0.55 ? "#ffffff" : "#1d232a", "text-anchor": "middle", "dominant-baseline": "middle",
                 "pointer-events": "none" });
      });
    });
  }

  function summaryFigure() {
    var src = source();
    var names = Object.keys(src.stats);
    var panels = (src.labels ? [null] : []).concat(names);
    var pw = panelWidth(src, names), ph = TOP + src.layers * CH + PANEL_GAP;
    var perRow = Math.max(1, Math.floor((WIDTH + PANEL_GAP) / pw));
    var fig = new Q.Figure(Math.min(panels.length, perRow) * pw, Math.ceil(panels.length / perRow) * ph);
    panels.forEach(function (name, i) {
      var x = (i % perRow) * pw, y = Math.floor(i / perRow) * ph;
      if (name === null) { labelPanel(fig, x, y, src); } else { statPanel(fig, x, y, src, name); }
    });
    fig.note = src.note;
    return fig;
  }

  function draw() {
    var view = Q.currentView();
    var corpus = corpusFor(view);
    Q.$("summary-corpus-toggle").hidden = !corpus;
    if (corpus) {
      Q.$("summary-corpus").disabled = !view.stats;
      Q.$("summary-corpus-note").textContent = "(" + Q.data.corpus.sentences + " sentences of " + Q.data.corpus.file + ")";
    }
    var fig = summaryFigure();
    Q.$("summary-caption").textContent = view.name + ", " + fig.note;
    var svg = fig.toSVG(Q.$("summary-svg"));
    svg.onclick = function (event) {
      var cell = event.target.closest("[data-layer]");
      if (cell) { Q.openHead(Number(cell.dataset.layer), Number(cell.dataset.head)); }
    };
  }

  Q.register({
    id: "summary",
    available: function () { var view = Q.currentView(); return Boolean(view.stats || corpusFor(view)); },
    draw: draw,
    figures: {
      summary: function () {
        var fig = summaryFigure();
        return Q.titled(fig, Q.currentView().name + ": head summary, " + fig.note);
      }
    }
  });
})(window.qkvExplorer);
