/* qkv attention explorer: the head view (one layer, the heads switched on, as lines) and the model
 * view (every layer x head as a heatmap) (attention.js). A long input's head view (reduced weights,
 * longview.js) adds a caption of what is aggregated and an overview of the layer's block means. */
(function (Q) {
  "use strict";

  var CELL = 64; // model view cell size in CSS pixels
  var MAX_CELL_PIXELS = 128; // longer inputs: each heatmap pixel is the largest weight of its block
  var ACCENT = "#2458b3";

  function headSpec() {
    var view = Q.currentView();
    var spec = {
      queries: view.queries,
      keys: view.keys,
      matrices: Q.range(view.heads).filter(function (h) { return Q.state.heads[h]; }).map(function (h) {
        var m = Q.matrixOf(view, "attention", Q.state.layer, h);
        m.head = h;
        m.color = Q.headColor(h, view.heads);
        return m;
      })
    };
    if (Q.isReduced(view.attention)) { spec.onWindow = Q.drawOverview; }
    return spec;
  }

  function drawHeadView() {
    var view = Q.currentView();
    Q.describeLong(view, "attention", Q.$("head-svg"));
    Q.drawTokenLines(Q.$("head-svg"), headSpec());
    Q.drawOverview();
  }

  /* The heatmaps are drawn once per example and view; a new layer or head only moves the outline. */
  function drawModelView() {
    var view = Q.currentView();
    var grid = Q.$("model-grid");
    var key = Q.state.example + ":" + Q.state.view;
    if (grid.dataset.key !== key) {
      grid.textContent = "";
      grid.style.gridTemplateColumns = "28px repeat(" + view.heads + ", " + (CELL + 4) + "px)";
      grid.appendChild(axis(""));
      Q.range(view.heads).forEach(function (h) { grid.appendChild(axis("h" + h)); });
      for (var l = 0; l < view.layers; l++) {
        grid.appendChild(axis("L" + l));
        for (var h = 0; h < view.heads; h++) { grid.appendChild(heatmap(view, l, h)); }
      }
      grid.dataset.key = key;
    }
    Array.prototype.forEach.call(grid.querySelectorAll("canvas.cell"), function (cell) {
      var current = Number(cell.dataset.layer) === Q.state.layer && Q.state.heads[Number(cell.dataset.head)];
      cell.classList.toggle("current", Boolean(current));
    });
  }

  function axis(text) { return Q.html("div", { "class": "axis" }, null, text); }

  /* One heatmap: white (0) to the accent colour (1); for inputs longer than MAX_CELL_PIXELS each
   * pixel shows the largest weight of the block of queries x keys it covers; for a long input's
   * reduced weights (qkv.viz.long_inputs) each pixel is a block's mean weight (Q.relative). */
  function heatmap(view, l, h) {
    var nq = view.queries.length, nk = view.keys.length;
    var rows = Math.min(nq, MAX_CELL_PIXELS), cols = Math.min(nk, MAX_CELL_PIXELS);
    var canvas = Q.html("canvas", { "class": "cell", title: "layer " + l + ", head " + h });
    canvas.width = cols;
    canvas.height = rows;
    canvas.style.width = CELL + "px";
    canvas.style.height = CELL + "px";
    canvas.dataset.layer = String(l);
    canvas.dataset.head = String(h);
    var block;
    if (Q.isReduced(view.attention)) { // a long input: the block means (longview.js's Q.relative shade)
      var b = Q.blocksOf(view.attention, l, h);
      canvas.width = cols = b.cols;
      canvas.height = rows = b.rows;
      block = Q.relative(b.means);
      canvas.title += ": mean weight of each " + b.block[0] + " x " + b.block[1] + "-token block (shade: square root of mean / largest)";
    } else {
      block = maxBlocks(view.attention[l][h], nq, nk, rows, cols);
    }
    var ctx = canvas.getContext("2d");
    var image = ctx.createImageData(cols, rows);
    for (var i = 0; i < block.length; i++) {
      var v = Math.max(0, Math.min(1, block[i]));
      image.data[4 * i] = Math.round(255 - v * (255 - 36));
      image.data[4 * i + 1] = Math.round(255 - v * (255 - 88));
      image.data[4 * i + 2] = Math.round(255 - v * (255 - 179));
      image.data[4 * i + 3] = 255;
    }
    ctx.putImageData(image, 0, 0);
    canvas.addEventListener("click", function () { Q.openHead(l, h); });
    return canvas;
  }

  /* The largest weight of each block of the rows x cols grid over nq x nk weights. */
  function maxBlocks(w, nq, nk, rows, cols) {
    var block = new Float64Array(rows * cols);
    for (var q = 0; q < nq; q++) {
      var r = Math.floor((q * rows) / nq), row = w[q];
      for (var k = 0; k < nk; k++) {
        var p = r * cols + Math.floor((k * cols) / nk);
        if (row[k] > block[p]) { block[p] = row[k]; }
      }
    }
    return block;
  }

  function modelFigure() {
    var view = Q.currentView();
    var pitch = CELL + 4;
    var fig = new Q.Figure(28 + view.heads * pitch, 18 + view.layers * pitch);
    Q.range(view.heads).forEach(function (h) {
      fig.text({ x: 28 + h * pitch + pitch / 2, y: 9, text: "h" + h, "font-size": 11, fill: "#66707a",
                 "text-anchor": "middle", "dominant-baseline": "middle" });
    });
    Array.prototype.forEach.call(Q.$("model-grid").querySelectorAll("canvas.cell"), function (cell) {
      var l = Number(cell.dataset.layer), h = Number(cell.dataset.head);
      var x = 28 + h * pitch, y = 18 + l * pitch;
      if (h === 0) {
        fig.text({ x: 14, y: y + pitch / 2, text: "L" + l, "font-size": 11, fill: "#66707a",
                   "text-anchor": "middle", "dominant-baseline": "middle" });
      }
      fig.image({ x: x + 2, y: y + 2, width: CELL, height: CELL, canvas: cell });
      if (cell.classList.contains("current")) {
        fig.rect({ x: x + 1, y: y + 1, width: CELL + 2, height: CELL + 2, fill: "none", stroke: ACCENT, "stroke-width": 2 });
      }
    });
    return fig;
  }

  function headFigure() {
    var view = Q.currentView();
    var heads = Q.range(view.heads).filter(function (h) { return Q.state.heads[h]; });
    return Q.titled(Q.tokenLinesFigure(Q.$("head-svg")),
                    view.name + ", layer " + Q.state.layer + ", heads " + (heads.join(" ") || "none"));
  }

  Q.register({
    id: "attention",
    available: function () { return true; },
    needs: function () { return [[Q.currentView().attention, Q.state.layer]]; },
    draw: function () { drawHeadView(); drawModelView(); },
    figures: { "head-view": headFigure, "model-view": modelFigure }
  });
})(window.qkvExplorer);
