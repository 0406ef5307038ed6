/* qkv attention explorer: attribution of generated tokens (attribution.js). example.attribution
 * has the prompt's tokens, the generated tokens (chips to click) and, for each generated token, its
 * probability and two attributions over its context (the first `context` tokens of the prompt then
 * the generated ones, attribution.py): gradient x input of its log-probability (signed; orange
 * raised it, blue lowered it; opacity |score| over the step's largest |score|) and the attention
 * rollout row of the position that chose it (opacity weight over the step's largest weight).
 * Context tokens that were themselves generated have a dashed outline. The chips and panels:
 * scores.js. */
(function (Q) {
  "use strict";

  Q.state.attribution = { example: -1, step: 0 };

  function attribution() { return Q.currentExample().attribution; }

  function syncState(a) {
    var st = Q.state.attribution;
    if (st.example !== Q.state.example) { st.example = Q.state.example; st.step = 0; }
    st.step = Math.min(st.step, a.steps.length - 1);
    return st;
  }

  function attributionFigure() {
    var a = attribution(), st = syncState(a), step = a.steps[st.step], token = a.generated[st.step];
    var tokens = a.prompt.concat(a.generated).slice(0, step.context);
    return Q.scoreFigure(
      tokens,
      { title: "gradient \u00d7 input for \u201c" + token + "\u201d (step " + st.step + ", p = " +
               Q.formatProb(step.prob) + ")",
        subtitle: "orange raised it, blue lowered it", values: step.scores, kind: "score" },
      { title: "rollout of \u201c" + token + "\u201d through every layer", values: step.rollout, kind: "rollout" },
      a.prompt.length);
  }

  function draw() {
    var a = attribution(), st = syncState(a);
    Q.$("attribution-about").textContent = "each token of the " + a.about +
      " attributed to the tokens before it; click a generated token";
    Q.pickerChips(Q.$("attribution-steps"), a.generated, st.step,
                  function (i) { Q.state.attribution.step = i; Q.render(); }, "step-chip",
                  function (i) { return "p = " + Q.formatProb(a.steps[i].prob); });
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
