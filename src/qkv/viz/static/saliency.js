/* qkv attention explorer: what an output depended on (saliency.js). example.saliency has the
 * outputs (chips to click), the input tokens, and for each output the gradient x input score of
 * every input token (signed) and the attention weights of the same output. Clicking an output shades
 * the inputs by its scores (orange raises the output, blue lowers it; opacity |score| over the
 * largest |score| of that output) and, beside them, by its attention weights (opacity weight over
 * the largest weight), since attention weight and influence are not the same thing. */
(function (Q) {
  "use strict";

  var POSITIVE = "#d9480f", NEGATIVE = "#1c7ed6", ATTENTION = "#5f3dc4";
  var PANEL = 560, CHIP_H = 22, CHIP_GAP = 4, LINE = 26, TOP = 44, FONT = 13;

  Q.state.saliencyOutput = 0;

  function saliency() { return Q.currentExample().saliency; }

  function largest(values) {
    return values.reduce(function (m, v) { return Math.max(m, Math.abs(v)); }, 0);
  }

  /* Wrapped chips of the input tokens, each shaded by colorOf(value) at |value| / top. */
  function chips(g, inputs, values, kind, colorOf) {
    var top = largest(values) || 1;
    var x = 0, y = TOP;
    inputs.forEach(function (token, i) {
      var w = Math.ceil(Q.textWidth(token, FONT)) + 12;
      if (x > 0 && x + w > PANEL) { x = 0; y += LINE; }
      var v = values[i], opacity = Math.min(1, Math.abs(v) / top);
      g.rect({ "class": kind, x: x, y: y, width: w, height: CHIP_H, rx: 4, fill: colorOf(v),
               "fill-opacity": opacity.toFixed(3), stroke: "#d9dee3", "data-index": i, "data-value": v,
               title: token + ": " + v.toFixed(4) });
      g.text({ x: x + w / 2, y: y + CHIP_H / 2, text: token, "font-size": FONT, "text-anchor": "middle",
               "dominant-baseline": "middle", fill: opacity > 0.6 ? "#ffffff" : "#1d232a", "pointer-events": "none" });
      x += w + CHIP_GAP;
    });
    return y + LINE;
  }

  function panel(fig, dx, title, subtitle) {
    var g = fig.group({ dx: dx, dy: 0, "class": "panel" });
    g.text({ x: 0, y: 12, text: title, "font-size": 13, "font-weight": "bold", fill: "#1d232a" });
    g.text({ x: 0, y: 30, text: subtitle, "font-size": 11, fill: "#66707a" });
    return g;
  }

  function saliencyFigure() {
    var s = saliency(), o = Q.state.saliencyOutput;
    var scores = s.scores[o], attention = s.attention[o], output = s.outputs[o];
    var fig = new Q.Figure(2 * PANEL + 40, 0);
    var left = panel(fig, 0, "gradient \u00d7 input for \u201c" + output + "\u201d",
                     "orange raises it, blue lowers it; shade: |score| / " + largest(scores).toPrecision(3));
    var right = panel(fig, PANEL + 40, "attention weight of \u201c" + output + "\u201d",
                      "shade: weight / " + largest(attention).toPrecision(3));
    var bottom = Math.max(
      chips(left, s.inputs, scores, "score", function (v) { return v >= 0 ? POSITIVE : NEGATIVE; }),
      chips(right, s.inputs, attention, "attention", function () { return ATTENTION; }));
    fig.height = Math.ceil(bottom);
    return fig;
  }

  function drawOutputs(s) {
    var box = Q.$("saliency-outputs");
    var key = Q.state.example + ":" + s.outputs.length;
    if (box.dataset.key !== key) {
      box.textContent = "";
      s.outputs.forEach(function (label, i) {
        var chip = Q.html("button", { type: "button", "class": "output-chip", "data-index": String(i) }, box, label);
        chip.addEventListener("click", function () { Q.state.saliencyOutput = i; Q.render(); });
      });
      box.dataset.key = key;
    }
    Array.prototype.forEach.call(box.querySelectorAll(".output-chip"), function (chip) {
      chip.setAttribute("aria-pressed", Number(chip.dataset.index) === Q.state.saliencyOutput ? "true" : "false");
    });
  }

  function draw() {
    var s = saliency();
    if (Q.state.saliencyOutput >= s.outputs.length) { Q.state.saliencyOutput = 0; }
    Q.$("saliency-about").textContent = "gradient \u00d7 input of the " + s.about + "; click an output";
    drawOutputs(s);
    saliencyFigure().toSVG(Q.$("saliency-svg"));
  }

  Q.register({
    id: "saliency",
    available: function () { return Boolean(saliency()); },
    draw: draw,
    figures: {
      saliency: function () {
        var fig = saliencyFigure();
        var note = "Attention weight and influence are not the same thing.";
        return Q.titled(fig, "saliency (" + saliency().about + ") of \u201c" + Q.currentExample().text + "\u201d. " + note);
      }
    }
  });
})(window.qkvExplorer);
