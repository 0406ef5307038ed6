/* qkv attention explorer: shared state and helpers (core.js).
 * Plain browser JavaScript with no dependencies and no network access: the data is read from the
 * <script id="qkv-data" type="application/json"> element of the page. html.py inlines the files
 * core.js, figure.js, lines.js, longlines.js, longview.js, attention.js, summary.js, rollout.js, saliency.js, compare.js,
 * export.js and main.js, in that order, into one <script>; they share the object
 * window.qkvExplorer (called Q in each file). Token text is only ever set with textContent. */
(function () {
  "use strict";

  var Q = window.qkvExplorer = {};

  /* The page's copy of the document has each view's "attention" and "rollout" packed by html.py
   * (pack_weights) as { packed: "qkv-weights/1", shape, scale, data }: base64 of the zlib-compressed
   * uint16 weights in units of 1/scale, all high bytes first, then all low bytes. Unpacked, they are
   * the same nested arrays as in the JSON, with Float32Array rows (views into one buffer per
   * array): a 512-token view is 6 x 12 x 512 x 512 numbers. Lists that are not packed (qkv serve's
   * answers) are left as they are. */
  var PACKED = "qkv-weights/1";

  function base64Bytes(text) {
    if (Uint8Array.fromBase64) { return Uint8Array.fromBase64(text); }
    var raw = atob(text), bytes = new Uint8Array(raw.length);
    for (var i = 0; i < raw.length; i++) { bytes[i] = raw.charCodeAt(i); }
    return bytes;
  }

  function nest(values, shape) {
    var rowLength = shape[shape.length - 1];
    function build(depth, offset) {
      if (depth === shape.length - 1) { return values.subarray(offset, offset + rowLength); }
      var out = [], stride = values.length;
      for (var d = 0; d <= depth; d++) { stride /= shape[d]; }
      for (var i = 0; i < shape[depth]; i++) { out.push(build(depth + 1, offset + i * stride)); }
      return out;
    }
    return build(0, 0);
  }

  function unpack(packed) {
    if (typeof DecompressionStream === "undefined") {
      return Promise.reject(new Error("this browser cannot unpack the page's data (it has no DecompressionStream)"));
    }
    var n = packed.shape.reduce(function (a, b) { return a * b; }, 1);
    var stream = new Blob([base64Bytes(packed.data)]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Response(stream).arrayBuffer().then(function (buffer) {
      if (buffer.byteLength !== 2 * n) {
        throw new Error("packed weights of shape " + packed.shape.join("x") + " hold " + buffer.byteLength + " bytes");
      }
      var high = new Uint8Array(buffer, 0, n), low = new Uint8Array(buffer, n, n);
      var values = new Float32Array(n), scale = packed.scale;
      for (var i = 0; i < n; i++) { values[i] = (high[i] * 256 + low[i]) / scale; }
      return nest(values, packed.shape);
    });
  }

  /* A long input's reduced weights (qkv.viz.long_inputs, packed by qkv.viz.page_long): { reduced,
   * shape, k, block, index, weight, blocks }, each of the three arrays { packed: "qkv-layers/1",
   * dtype, shape, scale, layers: [base64 of zlib bytes] }. The block means ("blocks", small) are
   * inflated when the page opens; a layer's top-k "index" and "weight" when it is first shown
   * (Q.needLayers), into value.loaded[l] = { index: Uint16Array, weight: Float32Array }. */
  var LAYERS = "qkv-layers/1";

  function inflate(text) {
    if (typeof DecompressionStream === "undefined") {
      return Promise.reject(new Error("this browser cannot unpack the page's data (it has no DecompressionStream)"));
    }
    var stream = new Blob([base64Bytes(text)]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Response(stream).arrayBuffer();
  }

  function words(buffer, scale) {
    var n = buffer.byteLength / 2, high = new Uint8Array(buffer, 0, n), low = new Uint8Array(buffer, n, n);
    var out = scale === 1 ? new Uint16Array(n) : new Float32Array(n);
    for (var i = 0; i < n; i++) { out[i] = (high[i] * 256 + low[i]) / scale; }
    return out;
  }

  function prepareReduced(value) {
    if (value.index.packed !== LAYERS || value.weight.packed !== LAYERS || value.blocks.packed !== LAYERS) {
      return Promise.reject(new Error("unknown packing of reduced weights"));
    }
    value.loaded = [];
    value.loading = [];
    return inflate(value.blocks.layers[0]).then(function (buffer) {
      value.blockMeans = new Float32Array(buffer);
      var s = value.shape, nq = Math.ceil(s[s.length - 2] / value.block[0]), nk = Math.ceil(s[s.length - 1] / value.block[1]);
      value.blockShape = [nq, nk];
      if (value.blockMeans.length !== value.blocks.shape.reduce(function (a, b) { return a * b; }, 1)) {
        throw new Error("reduced weights: block means of the wrong size");
      }
    });
  }

  /* Whether a view's "attention" or "rollout" is a long input's reduced form. */
  Q.isReduced = function (value) { return Boolean(value && value.reduced); };

  /* Layer l of a reduced value inflated; a promise (resolved at once when it already is). */
  Q.loadLayer = function (value, l) {
    if (value.loaded[l]) { return Promise.resolve(value.loaded[l]); }
    if (!value.loading[l]) {
      value.loading[l] = Promise.all([inflate(value.index.layers[l]), inflate(value.weight.layers[l])]).then(function (b) {
        var t0 = performance.now();
        value.loaded[l] = { index: words(b[0], 1), weight: words(b[1], value.weight.scale) };
        Q.timings.decoded = (Q.timings.decoded || 0) + performance.now() - t0;
        return value.loaded[l];
      });
    }
    return value.loading[l];
  };

  /* Null when layer l of each [value, l] pair is ready, else a promise of when they all are. */
  Q.needLayers = function (pairs) {
    var missing = pairs.filter(function (p) { return Q.isReduced(p[0]) && !p[0].loaded[p[1]]; });
    if (!missing.length) { return null; }
    return Promise.all(missing.map(function (p) { return Q.loadLayer(p[0], p[1]); }));
  };

  /* One matrix of a view's "attention" (layer l, head h) or "rollout" (layer l; h ignored) for the
   * line drawings: { weights: [s_q][s_k] } (every weight) or, for a reduced form whose layer is
   * loaded, { sparse: { k, index, weight } }: row q's K largest weights are weight[q K .. q K + K - 1],
   * at keys index[...] (largest first). */
  Q.matrixOf = function (view, key, l, h) {
    var value = view[key];
    if (!Q.isReduced(value)) { return { weights: key === "rollout" ? value[l] : value[l][h] }; }
    var layer = value.loaded[l], k = value.k, s = value.shape;
    var rows = s[s.length - 2], per = key === "rollout" ? 0 : h * rows * k;
    return { sparse: { k: k, index: layer.index.subarray(per, per + rows * k), weight: layer.weight.subarray(per, per + rows * k) } };
  };

  /* The block means of layer l, head h (h ignored for a rollout): { rows, cols, block: [b_q, b_k], means }. */
  Q.blocksOf = function (value, l, h) {
    var nq = value.blockShape[0], nk = value.blockShape[1], n = nq * nk;
    var offset = value.shape.length === 4 ? (l * value.shape[1] + h) * n : l * n;
    return { rows: nq, cols: nk, block: value.block, means: value.blockMeans.subarray(offset, offset + n) };
  };

  /* Unpack, in place, the packed arrays of these examples' views; a promise of when it is done. */
  Q.unpackExamples = function (examples) {
    var jobs = [];
    (examples || []).forEach(function (example) {
      (example.views || []).forEach(function (view) {
        ["attention", "rollout"].forEach(function (key) {
          var value = view[key];
          if (Q.isReduced(value)) {
            jobs.push(prepareReduced(value));
          } else if (value && value.packed === PACKED) {
            jobs.push(unpack(value).then(function (nested) { view[key] = nested; }));
          } else if (value && value.packed) {
            jobs.push(Promise.reject(new Error("unknown packing " + value.packed)));
          }
        });
      });
    });
    return Promise.all(jobs);
  };

  /* Milliseconds each panel last took to draw; when the script started, when its data was parsed
   * and when the first draw ended, since navigation start (read by benchmarks/explorer_draw.py). */
  Q.timings = { script: performance.now() };
  Q.SVGNS = "http" + "://www.w3.org/2000/svg";
  Q.data = JSON.parse(document.getElementById("qkv-data").textContent);
  Q.timings.parsed = performance.now();
  /* Resolved when the packed weights are unpacked (see Q.unpackExamples); main.js draws then. */
  Q.ready = Q.unpackExamples(Q.data.examples).then(function () { Q.timings.unpacked = performance.now(); });
  Q.live = Q.data.live || null;
  /* tab: the panel shown; focus: the token the pointer is on in the head view */
  Q.state = { example: 0, view: 0, layer: 0, heads: [], tab: "attention" };
  /* Each panel registers { id, title, available(), draw(), figure() } (figure(): what Save PNG/SVG
   * write, a Q.Figure). */
  Q.tabs = [];

  Q.$ = function (id) { return document.getElementById(id); };

  Q.range = function (n) { var out = []; for (var i = 0; i < n; i++) { out.push(i); } return out; };

  /* An HTML element with attributes and (as textContent, never markup) a text. */
  Q.html = function (tag, attrs, parent, text) {
    var node = document.createElement(tag);
    for (var name in attrs || {}) { node.setAttribute(name, attrs[name]); }
    if (text !== undefined) { node.textContent = text; }
    if (parent) { parent.appendChild(node); }
    return node;
  };

  Q.headColor = function (h, n) { return "hsl(" + Math.round((h * 360) / Math.max(n, 1)) + ", 70%, 42%)"; };

  Q.currentExample = function () { return Q.data.examples[Q.state.example]; };
  Q.currentView = function () { return Q.currentExample().views[Q.state.view]; };

  /* The view named `name` of example `e`, or null. */
  Q.viewNamed = function (e, name) {
    var views = Q.data.examples[e].views;
    for (var i = 0; i < views.length; i++) { if (views[i].name === name) { return views[i]; } }
    return null;
  };

  Q.showError = function (message) {
    var box = Q.$("error");
    box.textContent = message;
    box.hidden = false;
  };

  Q.hideError = function () { Q.$("error").hidden = true; };

  Q.setOptions = function (select, labels, selected) {
    select.textContent = "";
    labels.forEach(function (label, i) { Q.html("option", { value: String(i) }, select, label); });
    select.value = String(selected);
  };

  Q.register = function (tab) { Q.tabs.push(tab); };

  Q.tab = function (id) {
    for (var i = 0; i < Q.tabs.length; i++) { if (Q.tabs[i].id === id) { return Q.tabs[i]; } }
    return null;
  };

  /* A value in [0, 1] as the fill/stroke opacity attribute the views write (3 decimals). */
  Q.opacity = function (v) { return Math.max(0, Math.min(1, v)).toFixed(3); };

  /* Draw the panel of the current tab (the others are hidden and left as they are). Each draw
   * adds one to <body data-renders>, which tests and the benchmark wait on. */
  Q.render = function () {
    var tab = Q.tab(Q.state.tab);
    if (!tab || !tab.available()) { tab = Q.tab("attention"); Q.state.tab = "attention"; }
    Q.syncTabs();
    /* a long input's layer is inflated when first shown: draw when it is (tab.needs(): [value, layer] pairs) */
    var waiting = tab.needs ? Q.needLayers(tab.needs()) : null;
    if (waiting) {
      document.body.dataset.loading = "true";
      waiting.then(function () { delete document.body.dataset.loading; Q.render(); },
                   function (err) { Q.showError("cannot read the page's data: " + err.message); });
      return;
    }
    try {
      var example = Q.currentExample();
      Q.$("model-name").textContent = example.model ? "model: " + example.model : "";
      Q.$("output").textContent = example.output ? "output: " + example.output : "";
      var start = performance.now();
      tab.draw();
      var end = performance.now();
      Q.timings[tab.id] = end - start;
      if (Q.timings.first === undefined) { Q.timings.first = end; }
      Q.renders = (Q.renders || 0) + 1;
      document.body.dataset.renders = String(Q.renders);
    } catch (err) {
      Q.showError("cannot draw this attention: " + err.message);
      throw err;
    }
  };

  /* Tab buttons: shown when the data has what the panel draws; the current one pressed. */
  Q.syncTabs = function () {
    document.body.dataset.tab = Q.state.tab;
    Q.tabs.forEach(function (tab) {
      var button = document.querySelector("#tabs button[data-tab='" + tab.id + "']");
      if (button) {
        button.hidden = !tab.available();
        button.setAttribute("aria-selected", tab.id === Q.state.tab ? "true" : "false");
      }
    });
    Array.prototype.forEach.call(document.querySelectorAll("main > section"), function (section) {
      section.hidden = section.dataset.tab !== Q.state.tab;
    });
    var shown = Q.tabs.filter(function (tab) { return tab.available(); }).length;
    Q.$("tabs").hidden = shown < 2;
  };

  Q.setTab = function (id) {
    Q.state.tab = id;
    Q.render();
  };
})();
