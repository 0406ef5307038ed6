/* qkv attention explorer: what an output depended on (saliency.js). example.saliency has the
 * outputs (chips to click), the input tokens, and for each output the gradient x input score of
 * every input token (signed) and the attention weights of the same output. Clicking an output shades
 * the inputs by its scores (orange raises the output, blue lowers it; opacity |score| over the
 * largest |score| of that output) and, beside them, by its attention weights (opacity weight over
 * the largest weight), since attention weight and influence are not the same thing. The chips and
 * panels: scores.js. */
(function (Q) {
  "use strict";

  Q.state.saliencyOutput = 0;

  function saliency() { return Q.currentExample().saliency; }

  function saliencyFigure() {
    var s = saliency(), o = Q.state.saliencyOutput, output = s.outputs[o];
    return Q.scoreFigure(
      s.inputs,
      { title: "gradient \u00d7 input for \u201c" + output + "\u201d", subtitle: "orange raises it, blue lowers it",
        values: s.scores[o], kind: "score" },
      { title: "attention weight of \u201c" + output + "\u201d", values: s.attention[o], kind: "attention" });
  }

  function draw() {
    var s = saliency();
    if (Q.state.saliencyOutput >= s.outputs.length) { Q.state.saliencyOutput = 0; }
    Q.$("saliency-about").textContent = "gradient \u00d7 input of the " + s.about + "; click an output";
    Q.pickerChips(Q.$("saliency-outputs"), s.outputs, Q.state.saliencyOutput,
                  function (i) { Q.state.saliencyOutput = i; Q.render(); });
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
