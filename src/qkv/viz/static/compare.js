/* qkv attention explorer: two sentences side by side (compare.js). data.compare names two examples,
 * a view, the pairs of tokens they share and every layer/head with how much the attention of the
 * shared tokens differs, largest first. The page draws both sentences' view for one layer and head
 * (shared tokens in bold; hovering one focuses it on both sides) and lists the heads by difference;
 * clicking an entry shows that head. With each head's per-token differences ("per_token"), the
 * list can be sorted by one shared token's difference instead (that token is then focused). */
(function (Q) {
  "use strict";

  var TOP_IN_FIGURE = 10; // heads listed under an exported figure
  var COLOR = "#2458b3";

  Q.state.compareEntry = 0;
  Q.state.compareSort = -1; // -1: the difference over all shared tokens; i: shared pair i's own
  var version = 0; // counts the compare fields shown, so the list is rebuilt for a new one

  /* Show a new compare field (qkv serve: an answer with two sentences). */
  Q.setCompare = function (field) {
    Q.data.compare = field;
    Q.state.compareEntry = 0;
    Q.state.compareSort = -1;
    version += 1;
  };

  /* The number the list is sorted by, for a heads entry. */
  function measureOf(e) { return Q.state.compareSort < 0 ? e.difference : e.per_token[Q.state.compareSort]; }

  /* Indices into compare.heads, largest measure first (ties keep the document's order). */
  function order() {
    var heads = compare().heads;
    return Q.range(heads.length).sort(function (a, b) { return measureOf(heads[b]) - measureOf(heads[a]) || a - b; });
  }

  function hasPerToken() {
    var c = compare();
    return c.heads.every(function (e) { return Array.isArray(e.per_token) && e.per_token.length === (c.shared || []).length; });
  }

  function sharedLabel(i) {
    var pair = compare().shared[i];
    return views()[0].queries[pair[0]] + " (" + pair[0] + ", " + pair[1] + ")";
  }

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
      matrices: [Object.assign(Q.matrixOf(view, "attention", entry.layer, entry.head), { head: entry.head, color: COLOR })],
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
    var text = c.view + ", layer " + e.layer + ", head " + e.head + ": difference " + e.difference.toFixed(4);
    if (Q.state.compareSort >= 0) {
      text += "; " + views()[0].queries[c.shared[Q.state.compareSort][0]] + " alone " + measureOf(e).toFixed(4);
    }
    return text;
  }

  function drawSortOptions() {
    var select = Q.$("compare-sort");
    var perToken = hasPerToken();
    Q.$("compare-sort-label").hidden = !perToken;
    if (!perToken) { Q.state.compareSort = -1; return; }
    var key = version + ":" + compare().shared.length;
    if (select.dataset.key !== key) {
      select.textContent = "";
      Q.html("option", { value: "-1" }, select, "all shared tokens");
      compare().shared.forEach(function (_, i) { Q.html("option", { value: String(i) }, select, sharedLabel(i)); });
      select.dataset.key = key;
    }
    select.value = String(Q.state.compareSort);
  }

  function drawList() {
    var c = compare();
    var list = Q.$("compare-heads");
    var key = version + ":" + c.heads.length + ":" + Q.state.compareSort;
    if (list.dataset.key !== key) {
      list.textContent = "";
      var sorted = order();
      var top = measureOf(c.heads[sorted[0]]) || 1;
      sorted.forEach(function (i) {
        var e = c.heads[i];
        var item = Q.html("li", {}, list);
        var button = Q.html("button", { type: "button", "class": "compare-head", "data-index": String(i),
                                        "data-layer": String(e.layer), "data-head": String(e.head) }, item);
        Q.html("span", { "class": "name" }, button, "layer " + e.layer + " head " + e.head);
        Q.html("span", { "class": "value" }, button, measureOf(e).toFixed(4));
        var bar = Q.html("span", { "class": "bar" }, button);
        bar.style.width = Math.round(60 * Math.max(0, measureOf(e)) / top) + "px";
        button.addEventListener("click", function () { Q.state.compareEntry = i; Q.render(); });
      });
      list.dataset.key = key;
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
    Q.$("compare-measure").textContent = c.measure || "";
    drawSortOptions();
    Q.$("compare-caption").textContent = caption();
    Q.drawTokenLines(Q.$("compare-left"), spec(0, entry()));
    Q.drawTokenLines(Q.$("compare-right"), spec(1, entry()));
    drawList();
    if (Q.state.compareSort >= 0) {  // the token the list is sorted by, focused on both sides
      Q.focusTokenLines(Q.$("compare-left"), "query", c.shared[Q.state.compareSort][0], true);
    }
  }

  /* Sort the list by shared pair `i` (-1: all shared tokens) and show its first head. */
  Q.sortCompare = function (i) {
    Q.state.compareSort = i;
    Q.state.compareEntry = order()[0];
    Q.render();
  };

  function compareFigure() {
    var left = Q.tokenLinesFigure(Q.$("compare-left")), right = Q.tokenLinesFigure(Q.$("compare-right"));
    var heads = order().slice(0, TOP_IN_FIGURE).map(function (i) { return compare().heads[i]; });
    var listTop = Math.max(left.height, right.height) + 12;
    var fig = new Q.Figure(Math.max(left.width + 40 + right.width, 420), listTop + 20 + 16 * heads.length);
    fig.group({ dx: 0, dy: 0 }).items = left.items;
    fig.group({ dx: left.width + 40, dy: 0 }).items = right.items;
    var which = Q.state.compareSort < 0 ? "the shared tokens'" : "\u201c" + views()[0].queries[compare().shared[Q.state.compareSort][0]] + "\u201d's";
    fig.text({ x: 0, y: listTop + 8, text: "heads where " + which + " attention differs most (" +
               (compare().measure || "") + ")", "font-size": 12, "font-weight": "bold", "dominant-baseline": "middle" });
    heads.forEach(function (e, i) {
      fig.text({ x: 0, y: listTop + 28 + 16 * i, text: "layer " + e.layer + " head " + e.head + ": " + measureOf(e).toFixed(4),
                 "font-size": 12, "dominant-baseline": "middle" });
    });
    return Q.titled(fig, caption());
  }

  function needs() { // a long input's layer, inflated before the draw (core.js)
    var e = entry() || compare().heads[0];
    return views().map(function (v) { return [v.attention, e.layer]; });
  }

  Q.register({ id: "compare", available: available, needs: needs, draw: draw, figures: { compare: compareFigure } });
})(window.qkvExplorer);
