/* qkv attention explorer: what a long input's views say about themselves (longview.js). A view whose
 * weights are in the reduced form (qkv.viz.long_inputs: each query's K largest weights and the means
 * of blocks of tokens) gets, above its line drawing, a caption saying what is drawn and how it is
 * aggregated, and in the head view an overview: the block means of the layer (mean over the heads
 * switched on), the rows in view outlined; a click on it scrolls the lines there. */
(function (Q) {
  "use strict";

  var OVERVIEW = 256; // CSS pixels a side
  var ACCENT = [36, 88, 179];

  /* The square root of values / their largest (all 0 when they are all 0), as a new Float64Array: a
   * long row's block means are small next to the first rows' (a causal row 0 puts all its weight on
   * one key), so the root keeps them visible. */
  Q.relative = function (values) {
    var top = 0, out = new Float64Array(values.length);
    for (var i = 0; i < values.length; i++) { if (values[i] > top) { top = values[i]; } }
    for (var j = 0; j < values.length; j++) { out[j] = top > 0 ? Math.sqrt(values[j] / top) : 0; }
    return out;
  };

  function number(n) { return n.toLocaleString("en-US"); }

  /* The caption of the drawing in `svg` (its section's p.long-note, made on first use; hidden for a
   * view that is not reduced). */
  Q.describeLong = function (view, key, svg) {
    var host = svg.parentNode, section = host.parentNode;
    var note = section.querySelector("p.long-note");
    var value = view[key];
    if (!Q.isReduced(value)) { if (note) { note.hidden = true; } return; }
    if (!note) {
      note = Q.html("p", { "class": "caption long-note" });
      section.insertBefore(note, host);
    }
    var s = value.shape, rows = s[s.length - 2], cols = s[s.length - 1];
    note.hidden = false;
    note.textContent = number(rows) + " \u00d7 " + number(cols) + " tokens: too many weights to carry every one (" +
      number(s.reduce(function (a, b) { return a * b; }, 1)) + "), so the page holds each query's " + value.k +
      " largest weights exactly and the mean weight of each " + value.block[0] + " \u00d7 " + value.block[1] +
      "-token block. Lines: each query's " + value.k + " largest weights of 0.01 or more (a row's other weights are " +
      "smaller than its " + value.k + "th); only the rows in view are drawn. Hover shading: those weights only. " +
      (key === "attention" ? "Model view and overview (above; click it to scroll there): block means, shade the square root of " +
       "the mean over the largest." : "");
  };

  /* The head view's overview canvas (made on first use), or null for a view that is not reduced. */
  function overviewCanvas(view) {
    var svg = Q.$("head-svg"), host = svg.parentNode;
    var canvas = Q.$("head-overview");
    if (!Q.isReduced(view.attention)) { if (canvas) { canvas.hidden = true; } return null; }
    if (!canvas) {
      canvas = Q.html("canvas", { id: "head-overview", "class": "overview", title: "block means of this layer; click to scroll there" });
      canvas.style.display = "block";
      canvas.style.margin = "0 0 8px";
      canvas.style.imageRendering = "pixelated";
      canvas.style.cursor = "pointer";
      host.parentNode.insertBefore(canvas, host);
      canvas.addEventListener("click", function (event) {
        var v = Q.currentView(), b = v.attention.block, box = canvas.getBoundingClientRect();
        var blockRow = Math.floor(((event.clientY - box.top) / box.height) * canvas.qkvRows);
        Q.scrollLinesTo(svg, Math.min(v.queries.length - 1, blockRow * b[0] + Math.floor(b[0] / 2)));
      });
    }
    canvas.hidden = false;
    return canvas;
  }

  /* Draw the overview: the current layer's block means over the heads switched on, rows in view outlined. */
  Q.drawOverview = function () {
    var view = Q.currentView(), canvas = overviewCanvas(view);
    if (!canvas) { return; }
    var heads = Q.range(view.heads).filter(function (h) { return Q.state.heads[h]; });
    var first = Q.blocksOf(view.attention, Q.state.layer, 0), rows = first.rows, cols = first.cols;
    var sum = new Float64Array(rows * cols);
    heads.forEach(function (h) {
      var means = Q.blocksOf(view.attention, Q.state.layer, h).means;
      for (var i = 0; i < sum.length; i++) { sum[i] += means[i] / heads.length; }
    });
    var shade = Q.relative(sum);
    var scale = Math.max(1, Math.floor(OVERVIEW / Math.max(rows, cols)));
    canvas.width = cols * scale;
    canvas.height = rows * scale;
    canvas.qkvRows = rows;
    canvas.dataset.heads = heads.join(" ");
    var ctx = canvas.getContext("2d"), image = ctx.createImageData(cols, rows);
    for (var p = 0; p < shade.length; p++) {
      for (var c = 0; c < 3; c++) { image.data[4 * p + c] = Math.round(255 - shade[p] * (255 - ACCENT[c])); }
      image.data[4 * p + 3] = 255;
    }
    var raster = document.createElement("canvas");
    raster.width = cols;
    raster.height = rows;
    raster.getContext("2d").putImageData(image, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(raster, 0, 0, canvas.width, canvas.height);
    var svg = Q.$("head-svg"), win = svg.qkvLines && svg.qkvLines.window;
    if (win) {
      var b = view.attention.block[0];
      ctx.strokeStyle = "#e8590c";
      ctx.lineWidth = 2;
      ctx.strokeRect(1, Math.floor(win.first / b) * scale, canvas.width - 2,
                     Math.max(2, (Math.floor(win.last / b) - Math.floor(win.first / b) + 1) * scale));
    }
  };
})(window.qkvExplorer);
