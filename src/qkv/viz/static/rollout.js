/* qkv attention explorer: attention rollout (rollout.js). view.rollout[l] is how much each query
 * token draws on each key token through layers 0..l (Abnar & Zuidema 2020: mean over heads, plus
 * the identity for the residual, rows renormalised, multiplied across layers); drawn with the head
 * view's token layout, for the layer chosen with the Layer selector. */
(function (Q) {
  "use strict";

  var COLOR = "#2458b3";

  function spec() {
    var view = Q.currentView();
    var m = Q.matrixOf(view, "rollout", Q.state.layer, 0); // every weight, or a long input's largest (core.js)
    m.head = 0;
    m.color = COLOR;
    return { queries: view.queries, keys: view.keys, matrices: [m] };
  }

  function caption() {
    var view = Q.currentView();
    return view.name + ": rollout through layers 0 to " + Q.state.layer;
  }

  Q.register({
    id: "rollout",
    available: function () { return Boolean(Q.currentView().rollout); },
    needs: function () { return [[Q.currentView().rollout, Q.state.layer]]; },
    draw: function () {
      Q.$("rollout-caption").textContent = caption();
      Q.describeLong(Q.currentView(), "rollout", Q.$("rollout-svg"));
      Q.drawTokenLines(Q.$("rollout-svg"), spec());
    },
    figures: { rollout: function () { return Q.titled(Q.tokenLinesFigure(Q.$("rollout-svg")), caption()); } }
  });
})(window.qkvExplorer);
