/* qkv attention explorer: attribution of generated tokens (attribution.js). example.attribution
 * has the prompt's tokens, the generated tokens (chips to click) and, for each generated token, its
 * probability and two attributions over its context (the first `context` tokens of the prompt then
 * the generated ones, attribution.py): gradient x input of its log-probability (signed; orange
 * raised it, blue lowered it; opacity |score| over the step's largest |score|) and the attention
 * rollout row of the position that chose it (opacity weight over the step's largest weight).
 * Context tokens that were themselves generated have a dashed outline. */
(function (Q) {
  "use strict";

  var POSITIVE = "#d9480f", NEGATIVE = "#1c7ed6", ROLLOUT = "#5f3dc4";
  var PANEL = 560, CHIP_H = 22, CHIP_GAP = 4, LINE = 26, TOP = 44, FONT = 13;

  Q.state.attribution = { example: -1, step: 0 };

  function attribution() { return Q.currentExample().attribution; }

  function largest(values) {
    return values.reduce(function (m, v) { return Math.max(m, Math.abs(v)); }, 0);
  }

  function contextTokens(a, step) {
    return a.prompt.concat(a.generated).slice(0, a.steps[step].context);
  }

  function chips(g, tokens, values, prompt, kind, colorOf) {
    var top = largest(values) || 1, x = 0, y = TOP;
    tokens.forEach(function (token, i) {
      var w = Math.ceil(Q.textWidth(token, FONT)) + 12;
      if (x > 0 && x + w > PANEL) { x = 0; y += LINE; }
      var v = values[i], opacity = Math.min(1, Math.abs(v) / top);
      var attrs = { "class": kind + (i >= prompt ? " generated" : ""), x: x, y: y, width: w, height: CHIP_H, rx: 4,
                    fill: colorOf(v), "fill-opacity": opacity.toFixed(3), stroke: i >= prompt ? "#1d232a" : "#d9dee3",
                    "data-index": i, "data-value": v, title: token + ": " + v.toPrecision(4) };
      if (i >= prompt) { attrs["stroke-dasharray"] = "3 2"; }
      g.rect(attrs);
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

  function syncState(a) {
    var st = Q.state.attribution;
    if (st.example !== Q.state.example) { st.example = Q.state.example; st.step = 0; }
    st.step = Math.min(st.step, a.steps.length - 1);
    return st;
  }

  function attributionFigure() {
    var a = attribution(), st = syncState(a), step = a.steps[st.step];
    var tokens = contextTokens(a, st.step), token = a.generated[st.step], prompt = a.prompt.length;
    var fig = new Q.Figure(2 * PANEL + 40, 0);
    var left = panel(fig, 0, "gradient \u00d7 input for \u201c" + token + "\u201d (step " + st.step + ", p = " +
                     Q.formatProb(step.prob) + ")",
                     "orange raised it, blue lowered it; shade: |score| / " + largest(step.scores).toPrecision(3));
    var right = panel(fig, PANEL + 40, "rollout of \u201c" + token + "\u201d through every layer",
                      "shade: weight / " + largest(step.rollout).toPrecision(3));
    var bottom = Math.max(
      chips(left, tokens, step.scores, prompt, "score", function (v) { return v >= 0 ? POSITIVE : NEGATIVE; }),
      chips(right, tokens, step.rollout, prompt, "rollout", function () { return ROLLOUT; }));
    fig.height = Math.ceil(bottom);
    return fig;
  }

  function drawSteps(a, st) {
    var box = Q.$("attribution-steps");
    var key = Q.state.example + ":" + a.generated.length;
    if (box.dataset.key !== key) {
      box.textContent = "";
      a.generated.forEach(function (label, i) {
        var chip = Q.html("button", { type: "button", "class": "output-chip step-chip", "data-index": String(i),
                                      title: "p = " + Q.formatProb(a.steps[i].prob) }, box, label);
        chip.addEventListener("click", function () { Q.state.attribution.step = i; Q.render(); });
      });
      box.dataset.key = key;
    }
    Array.prototype.forEach.call(box.querySelectorAll(".step-chip"), function (chip) {
      chip.setAttribute("aria-pressed", Number(chip.dataset.index) === st.step ? "true" : "false");
    });
  }

  function draw() {
    var a = attribution(), st = syncState(a);
    Q.$("attribution-about").textContent = "each token of the " + a.about +
      " attributed to the tokens before it; click a generated token";
    drawSteps(a, st);
    attributionFigure().toSVG(Q.$("attribution-svg"));
  }

  Q.register({
    id: "attribution",
    available: function () { return Boolean(attribution()); },
    draw: draw,
    figures: {
      attribution: function () {
        var a = attribution();
        return Q.titled(attributionFigure(), "attribution of the " + a.about + " of \u201c" + Q.currentExample().text + "\u201d");
      }
    }
  });
})(window.qkvExplorer);
