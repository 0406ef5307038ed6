/* qkv attention explorer: scores over tokens, drawn as shaded chips (scores.js). What saliency.js
 * and attribution.js share: two panels over the same tokens (a signed score on the left, orange
 * raised the output and blue lowered it; a weight on the right, in one colour), each chip shaded by
 * |value| over its panel's largest |value|, and the row of buttons that picks which output is shown. */
(function (Q) {
  "use strict";

  var POSITIVE = "#d9480f", NEGATIVE = "#1c7ed6", WEIGHT = "#5f3dc4";
  var PANEL = 560, GAP = 40, CHIP_H = 22, CHIP_GAP = 4, LINE = 26, TOP = 44, FONT = 13;

  /* The largest |value| (0 for none). */
  Q.largestMagnitude = function (values) {
    return values.reduce(function (m, v) { return Math.max(m, Math.abs(v)); }, 0);
  };

  function signed(v) { return v >= 0 ? POSITIVE : NEGATIVE; }
  function weight() { return WEIGHT; }

  /* Wrapped chips of `tokens` in group g, rects of class `kind` shaded by colorOf(value); the tokens
   * from index `generated` on have a dashed dark outline and the class "generated". Returns the y
   * below the last line. */
  function chips(g, tokens, values, kind, colorOf, generated) {
    var top = Q.largestMagnitude(values) || 1, x = 0, y = TOP;
    tokens.forEach(function (token, i) {
      var w = Math.ceil(Q.textWidth(token, FONT)) + 12, made = i >= generated;
      if (x > 0 && x + w > PANEL) { x = 0; y += LINE; }
      var v = values[i], opacity = Math.min(1, Math.abs(v) / top);
      var attrs = { "class": kind + (made ? " generated" : ""), x: x, y: y, width: w, height: CHIP_H, rx: 4,
                    fill: colorOf(v), "fill-opacity": opacity.toFixed(3), stroke: made ? "#1d232a" : "#d9dee3",
                    "data-index": i, "data-value": v, title: token + ": " + v.toPrecision(4) };
      if (made) { attrs["stroke-dasharray"] = "3 2"; }
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

  /* The two panels over `tokens` as a Q.Figure. scores and weights: {title, subtitle, values, kind};
   * each subtitle gets "shade: ... / <largest>" appended; tokens from index `generated` on (default:
   * none) are marked as generated. */
  Q.scoreFigure = function (tokens, scores, weights, generated) {
    var from = generated === undefined ? Infinity : generated;
    var fig = new Q.Figure(2 * PANEL + GAP, 0);
    var left = panel(fig, 0, scores.title, scores.subtitle + "; shade: |score| / " +
                     Q.largestMagnitude(scores.values).toPrecision(3));
    var right = panel(fig, PANEL + GAP, weights.title, "shade: weight / " +
                      Q.largestMagnitude(weights.values).toPrecision(3));
    fig.height = Math.ceil(Math.max(chips(left, tokens, scores.values, scores.kind, signed, from),
                                    chips(right, tokens, weights.values, weights.kind, weight, from)));
    return fig;
  };

  /* Buttons in `box` (class "output-chip" plus extraClass), one per label, built again only when the
   * example or the labels' count changes; the one at index `selected` pressed; onPick(i) on a click.
   * titleOf(i), when given, is each button's tooltip. */
  Q.pickerChips = function (box, labels, selected, onPick, extraClass, titleOf) {
    var key = Q.state.example + ":" + labels.length;
    if (box.dataset.key !== key) {
      box.textContent = "";
      labels.forEach(function (label, i) {
        var attrs = { type: "button", "class": "output-chip" + (extraClass ? " " + extraClass : ""),
                      "data-index": String(i) };
        if (titleOf) { attrs.title = titleOf(i); }
        var chip = Q.html("button", attrs, box, label);
        chip.addEventListener("click", function () { onPick(i); });
      });
      box.dataset.key = key;
    }
    Array.prototype.forEach.call(box.querySelectorAll(".output-chip"), function (chip) {
      chip.setAttribute("aria-pressed", Number(chip.dataset.index) === selected ? "true" : "false");
    });
  };
})(window.qkvExplorer);
