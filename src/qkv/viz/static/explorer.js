/* qkv attention explorer: head view and model view of a "qkv-attention/1" document.
 * Plain browser JavaScript with no dependencies and no network access: the data is read from the
 * <script id="qkv-data" type="application/json"> element of the page. In live mode (qkv serve)
 * a form posts a sentence to the local server and the answer is added as a new example.
 * Token text is only ever set with textContent, never parsed as HTML. */
(function () {
  "use strict";

  var SVGNS = "http://www.w3.org/2000/svg";
  var MIN_WEIGHT = 0.01; // lines lighter than this are not drawn
  var ROW = 22; // pixels per token row in the head view
  var GAP = 260; // horizontal span of the lines
  var CELL = 64; // model view cell size in CSS pixels

  var data = JSON.parse(document.getElementById("qkv-data").textContent);
  var live = data.live || null;
  var state = { example: 0, view: 0, layer: 0, heads: [], focus: null };
  var renders = 0;

  function $(id) { return document.getElementById(id); }

  function el(tag, attrs, parent) {
    var node = document.createElementNS(SVGNS, tag);
    for (var name in attrs) { node.setAttribute(name, attrs[name]); }
    if (parent) { parent.appendChild(node); }
    return node;
  }

  function headColor(h, n) { return "hsl(" + Math.round((h * 360) / Math.max(n, 1)) + ", 70%, 42%)"; }

  function currentExample() { return data.examples[state.example]; }
  function currentView() { return currentExample().views[state.view]; }

  function showError(message) {
    var box = $("error");
    box.textContent = message;
    box.hidden = false;
  }

  function hideError() { $("error").hidden = true; }

  function setOptions(select, labels, selected) {
    select.textContent = "";
    labels.forEach(function (label, i) {
      var opt = document.createElement("option");
      opt.value = String(i);
      opt.textContent = label;
      select.appendChild(opt);
    });
    select.value = String(selected);
  }

  /* ---- selection ------------------------------------------------------------------------ */

  function setExample(i) {
    state.example = i;
    setOptions($("example-select"), data.examples.map(function (e) { return e.text; }), i);
    var views = currentExample().views;
    setView(Math.min(state.view, views.length - 1));
  }

  function setView(i) {
    state.view = i;
    setOptions($("view-select"), currentExample().views.map(function (v) { return v.name; }), i);
    var view = currentView();
    state.layer = Math.min(state.layer, view.layers - 1);
    if (state.heads.length !== view.heads) {
      state.heads = [];
      for (var h = 0; h < view.heads; h++) { state.heads.push(true); }
    }
    setOptions($("layer-select"), range(view.layers).map(function (l) { return String(l); }), state.layer);
    buildHeadToggles(view.heads);
    render();
  }

  function setLayer(l) {
    state.layer = l;
    $("layer-select").value = String(l);
    render();
  }

  function setHead(h, on) {
    state.heads[h] = on;
    syncHeadToggles();
    render();
  }

  function range(n) { var out = []; for (var i = 0; i < n; i++) { out.push(i); } return out; }

  function buildHeadToggles(n) {
    var box = $("head-toggles");
    box.textContent = "";
    range(n).forEach(function (h) {
      var b = document.createElement("button");
      b.type = "button";
      b.className = "head-toggle";
      b.dataset.head = String(h);
      b.title = "head " + h;
      b.textContent = String(h);
      b.style.setProperty("--c", headColor(h, n));
      b.addEventListener("click", function () { setHead(h, !state.heads[h]); });
      box.appendChild(b);
    });
    syncHeadToggles();
  }

  function syncHeadToggles() {
    var buttons = $("head-toggles").querySelectorAll(".head-toggle");
    Array.prototype.forEach.call(buttons, function (b) {
      b.setAttribute("aria-pressed", state.heads[Number(b.dataset.head)] ? "true" : "false");
    });
  }

  /* ---- head view ------------------------------------------------------------------------ */

  function textWidth(tokens) {
    var longest = tokens.reduce(function (m, t) { return Math.max(m, t.length); }, 1);
    return Math.min(220, 16 + 8 * longest);
  }

  function drawHeadView() {
    var view = currentView();
    var weights = view.attention[state.layer]; // [head][query][key]
    var svg = $("head-svg");
    svg.textContent = "";
    var left = textWidth(view.queries);
    var right = textWidth(view.keys);
    var rows = Math.max(view.queries.length, view.keys.length);
    svg.setAttribute("width", String(left + GAP + right));
    svg.setAttribute("height", String(ROW * rows + 16));
    var y = function (i) { return 8 + ROW * i + ROW / 2; };
    var lines = el("g", { "class": "lines" }, svg);
    for (var h = 0; h < view.heads; h++) {
      if (!state.heads[h]) { continue; }
      var color = headColor(h, view.heads);
      for (var q = 0; q < view.queries.length; q++) {
        for (var k = 0; k < view.keys.length; k++) {
          var w = weights[h][q][k];
          if (w < MIN_WEIGHT) { continue; }
          el("line", {
            x1: left, y1: y(q), x2: left + GAP, y2: y(k),
            stroke: color, "stroke-width": 2, "stroke-opacity": w.toFixed(4),
            "data-head": h, "data-q": q, "data-k": k
          }, lines);
        }
      }
    }
    drawTokens(svg, view.queries, "query", 0, left, y);
    drawTokens(svg, view.keys, "key", left + GAP, right, y);
  }

  function drawTokens(svg, tokens, side, x0, width, y) {
    var group = el("g", { "class": side + "s" }, svg);
    tokens.forEach(function (token, i) {
      var rect = el("rect", {
        "class": "weight", x: x0 + 2, y: y(i) - ROW / 2 + 2, width: width - 4, height: ROW - 4,
        "fill-opacity": 0, "data-index": i
      }, group);
      rect.dataset.side = side;
      var text = el("text", {
        "class": "token " + side, x: side === "query" ? x0 + width - 6 : x0 + 6, y: y(i), "data-index": i
      }, group);
      text.textContent = token;
      var target = [rect, text];
      target.forEach(function (node) {
        node.addEventListener("mouseenter", function () { focus(side, i); });
        node.addEventListener("mouseleave", function () { focus(null, -1); });
      });
    });
  }

  /* Hovering a query shows only its lines and shades the keys by its mean weight over the
   * heads shown; hovering a key does the same the other way round. */
  function focus(side, index) {
    state.focus = side === null ? null : { side: side, index: index };
    var view = currentView();
    var weights = view.attention[state.layer];
    var svg = $("head-svg");
    Array.prototype.forEach.call(svg.querySelectorAll("line"), function (line) {
      var keep = side === null ||
        (side === "query" && Number(line.dataset.q) === index) ||
        (side === "key" && Number(line.dataset.k) === index);
      line.classList.toggle("hidden", !keep);
    });
    var active = range(view.heads).filter(function (h) { return state.heads[h]; });
    Array.prototype.forEach.call(svg.querySelectorAll("rect.weight"), function (rect) {
      var j = Number(rect.dataset.index);
      var shade = 0;
      if (side !== null && rect.dataset.side !== side && active.length) {
        var sum = 0;
        active.forEach(function (h) {
          sum += side === "query" ? weights[h][index][j] : weights[h][j][index];
        });
        shade = sum / active.length;
      } else if (side !== null && rect.dataset.side === side && j === index) {
        shade = 0.25;
      }
      rect.setAttribute("fill-opacity", shade.toFixed(3));
    });
  }

  /* ---- model view ----------------------------------------------------------------------- */

  function drawModelView() {
    var view = currentView();
    var grid = $("model-grid");
    grid.textContent = "";
    grid.style.gridTemplateColumns = "28px repeat(" + view.heads + ", " + (CELL + 4) + "px)";
    grid.appendChild(axis(""));
    range(view.heads).forEach(function (h) { grid.appendChild(axis("h" + h)); });
    for (var l = 0; l < view.layers; l++) {
      grid.appendChild(axis("L" + l));
      for (var h = 0; h < view.heads; h++) { grid.appendChild(heatmap(view, l, h)); }
    }
  }

  function axis(text) {
    var d = document.createElement("div");
    d.className = "axis";
    d.textContent = text;
    return d;
  }

  function heatmap(view, l, h) {
    var nq = view.queries.length, nk = view.keys.length;
    var canvas = document.createElement("canvas");
    canvas.width = nk;
    canvas.height = nq;
    canvas.className = "cell" + (l === state.layer && state.heads[h] ? " current" : "");
    canvas.style.width = CELL + "px";
    canvas.style.height = CELL + "px";
    canvas.title = "layer " + l + ", head " + h;
    canvas.dataset.layer = String(l);
    canvas.dataset.head = String(h);
    var ctx = canvas.getContext("2d");
    var image = ctx.createImageData(nk, nq);
    var w = view.attention[l][h];
    for (var q = 0; q < nq; q++) {
      for (var k = 0; k < nk; k++) {
        var v = Math.max(0, Math.min(1, w[q][k]));
        var p = 4 * (q * nk + k);
        image.data[p] = Math.round(255 - v * (255 - 36));
        image.data[p + 1] = Math.round(255 - v * (255 - 88));
        image.data[p + 2] = Math.round(255 - v * (255 - 179));
        image.data[p + 3] = 255;
      }
    }
    ctx.putImageData(image, 0, 0);
    canvas.addEventListener("click", function () {
      state.heads = state.heads.map(function (_, i) { return i === h; });
      syncHeadToggles();
      setLayer(l);
      $("head-view").scrollIntoView({ block: "nearest" });
    });
    return canvas;
  }

  /* ---- page ----------------------------------------------------------------------------- */

  function render() {
    try {
      var example = currentExample();
      $("model-name").textContent = example.model ? "model: " + example.model : "";
      $("output").textContent = example.output ? "output: " + example.output : "";
      drawHeadView();
      drawModelView();
      renders += 1;
      document.body.dataset.renders = String(renders);
    } catch (err) {
      showError("cannot draw this attention: " + err.message);
      throw err;
    }
  }

  function wireControls() {
    $("example-select").addEventListener("change", function (e) { setExample(Number(e.target.value)); });
    $("view-select").addEventListener("change", function (e) { setView(Number(e.target.value)); });
    $("layer-select").addEventListener("change", function (e) { setLayer(Number(e.target.value)); });
    $("heads-all").addEventListener("click", function () {
      state.heads = state.heads.map(function () { return true; });
      syncHeadToggles();
      render();
    });
    $("heads-none").addEventListener("click", function () {
      state.heads = state.heads.map(function () { return false; });
      syncHeadToggles();
      render();
    });
  }

  function wireLive() {
    var form = $("live-form");
    form.hidden = false;
    var input = $("live-text");
    input.maxLength = live.max_chars;
    setOptions($("live-model"), live.models, 0);
    form.addEventListener("submit", function (event) {
      event.preventDefault();
      $("live-status").textContent = "running...";
      $("live-submit").disabled = true;
      var body = JSON.stringify({ text: input.value, model: live.models[Number($("live-model").value)] });
      fetch(live.endpoint, { method: "POST", headers: { "Content-Type": "application/json" }, body: body })
        .then(function (response) {
          return response.text().then(function (text) {
            var payload;
            try { payload = JSON.parse(text); } catch (e) { payload = { error: "HTTP " + response.status }; }
            if (!response.ok) { throw new Error(payload.error || "HTTP " + response.status); }
            return payload;
          });
        })
        .then(function (payload) {
          hideError();
          data.examples.push(payload.example);
          $("controls").hidden = false;
          setExample(data.examples.length - 1);
        })
        .catch(function (err) { showError(err.message); })
        .then(function () {
          $("live-status").textContent = "";
          $("live-submit").disabled = false;
        });
    });
  }

  document.title = data.title || document.title;
  $("title").textContent = data.title || "qkv attention explorer";
  wireControls();
  if (live) { wireLive(); }
  if (data.examples.length) {
    setExample(0);
  } else {
    $("controls").hidden = true;
    document.body.dataset.renders = "0";
  }
})();
