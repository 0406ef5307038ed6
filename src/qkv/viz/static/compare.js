/* qkv attention explorer: two sentences side by side (compare.js). data.compare names two examples,
 * a view, the pairs of tokens they share and every layer/head with how much the attention of the
 * shared tokens differs, largest first. The page draws both sentences' view for one layer and head
 * (shared tokens in bold; hovering one focuses it on both sides) and lists the heads by difference;
 * clicking an entry shows that head. */
(function (Q) {
  "use strict";

  var TOP_IN_FIGURE = 10; // heads listed under an exported figure

  Q.state.compareEntry = 0;

  function compare() { return Q.data.compare || null; }

  function views() {
    var c = compare();
    return [Q.viewNamed(c.examples[0], c.view), Q.viewNamed(c.examples[1], c.view)];
  }

  function available() {
    var c = compare();
    if (!c || !c.heads || !c.heads.length) { return false; }
    var n = Q.data.examples.length;
    if (!(c.examples[0] < n && c.examples[1] < n)) { return false; }
    var v = views();
    return Boolean(v[0] && v[1]);
  }

  /* The index (0 or 1) of a token's partner on the other side, or -1. */
  function partner(side, index) {
    var pairs = compare().shared || [];
    for (var i = 0; i < pairs.length; i++) {
      if (pairs[i][side] === index) { return pairs[i][1 - side]; }
    }
    return -1;
  }

  function sharedFlags(side, n) {
    var flags = Q.range(n).map(function () { return false; });
    (compare().shared || []).forEach(function (pair) { if (pair[side] < n) { flags[pair[side]] = true; } });
    return flags;
  }

  function spec(side, entry) {
    var view = views()[side];
    var flags = sharedFlags(side, view.queries.length);
    var selfAttention = view.queries.length === view.keys.length;
    return {
      queries: view.queries,
      keys: view.keys,
      matrices: [{ head: entry.head, color: Q.headColor(entry.head, view.heads),
                   weights: view.attention[entry.layer][entry.head] }],
      emphasis: { query: flags, key: selfAttention ? flags : view.keys.map(function () { return true; }) },
      onFocus: function (tokenSide, index) {
        var other = Q.$(side === 0 ? "compare-right" : "compare-left");
        var match = index < 0 || (tokenSide === "key" && !selfAttention) ? -1 : partner(side, index);
        Q.focusTokenLines(other, match < 0 ? null : tokenSide, match, false);
      }
    };
  }

  function entry() { return compare().heads[Q.state.compareEntry]; }

  function caption() {
    var c = compare(), e = entry();
    return c.view + ", layer " + e.layer + ", head " + e.head + ": difference " + e.difference.toFixed(4);
  }

  function drawList() {
    var c = compare();
    var list = Q.$("compare-heads");
    if (list.dataset.count !== String(c.heads.length)) {
      list.textContent = "";
      var top = c.heads[0].difference || 1;
      c.heads.forEach(function (e, i) {
        var item = Q.html("li", {}, list);
        var button = Q.html("button", { type: "button", "class": "compare-head", "data-index": String(i),
                                        "data-layer": String(e.layer), "data-head": String(e.head) }, item);
        Q.html("span", { "class": "name" }, button, "layer " + e.layer + " head " + e.head);
        Q.html("span", { "class": "value" }, button, e.difference.toFixed(4));
        var bar = Q.html("span", { "class": "bar" }, button);
        bar.style.width = Math.round(60 * Math.max(0, e.difference) / top) + "px";
        button.addEventListener("click", function () { Q.state.compareEntry = i; Q.render(); });
      });
      list.dataset.count = String(c.heads.length);
    }
    Array.prototype.forEach.call(list.querySelectorAll(".compare-head"), function (b) {
      b.setAttribute("aria-pressed", Number(b.dataset.index) === Q.state.compareEntry ? "true" : "false");
    });
  }

  function draw() {
    var c = compare();
    if (Q.state.compareEntry >= c.heads.length) { Q.state.compareEntry = 0; }
    Q.$("compare-about").textContent = "\u201c" + Q.data.examples[c.examples[0]].text + "\u201d vs \u201c" +
      Q.data.examples[c.examples[1]].text + "\u201d; shared tokens in bold, hover one to focus it on both sides";
    Q.$("compare-caption").textContent = caption();
    Q.$("compare-measure").textContent = c.measure || "";
    Q.drawTokenLines(Q.$("compare-left"), spec(0, entry()));
    Q.drawTokenLines(Q.$("compare-right"), spec(1, entry()));
    drawList();
  }

  function compareFigure() {
    var left = Q.tokenLinesFigure(Q.$("compare-left")), right = Q.tokenLinesFigure(Q.$("compare-right"));
    var heads = compare().heads.slice(0, TOP_IN_FIGURE);
    var listTop = Math.max(left.height, right.height) + 12;
    var fig = new Q.Figure(Math.max(left.width + 40 + right.width, 420), listTop + 20 + 16 * heads.length);
    fig.group({ dx: 0, dy: 0 }).items = left.items;
    fig.group({ dx: left.width + 40, dy: 0 }).items = right.items;
    fig.text({ x: 0, y: listTop + 8, text: "heads where the shared tokens' attention differs most: " +
               (compare().measure || ""), "font-size": 12, "font-weight": "bold", "dominant-baseline": "middle" });
    heads.forEach(function (e, i) {
      fig.text({ x: 0, y: listTop + 28 + 16 * i, text: "layer " + e.layer + " head " + e.head + ": " + e.difference.toFixed(4),
                 "font-size": 12, "dominant-baseline": "middle" });
    });
    return Q.titled(fig, caption());
  }

  Q.register({ id: "compare", available: available, draw: draw, figures: { compare: compareFigure } });
})(window.qkvExplorer);
