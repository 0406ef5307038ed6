/* qkv attention explorer: the controls (sentence, attention view, layer, heads, tabs), live mode and
 * start-up (main.js). In live mode (qkv serve) a form posts a sentence to the local server and the
 * answer is added as a new example. */
(function (Q) {
  "use strict";

  var state = Q.state;
  var $ = Q.$;

  Q.setExample = function (i) {
    state.example = i;
    state.saliencyOutput = 0;
    Q.setOptions($("example-select"), Q.data.examples.map(function (e) { return shortened(e.text, 80); }), i);
    Q.setView(Math.min(state.view, Q.currentExample().views.length - 1));
  };

  function shortened(text, limit) {
    return text.length > limit ? text.slice(0, limit - 1) + "\u2026" : text;
  }

  Q.setView = function (i) {
    state.view = i;
    Q.setOptions($("view-select"), Q.currentExample().views.map(function (v) { return v.name; }), i);
    var view = Q.currentView();
    state.layer = Math.min(state.layer, view.layers - 1);
    if (state.heads.length !== view.heads) { state.heads = Q.range(view.heads).map(function () { return true; }); }
    Q.setOptions($("layer-select"), Q.range(view.layers).map(String), state.layer);
    buildHeadToggles(view.heads);
    Q.render();
  };

  Q.setLayer = function (l) {
    state.layer = l;
    $("layer-select").value = String(l);
    Q.render();
  };

  /* Show layer l with only head h switched on, in the head view. */
  Q.openHead = function (l, h) {
    state.heads = state.heads.map(function (_, i) { return i === h; });
    syncHeadToggles();
    state.tab = "attention";
    Q.setLayer(l);
    $("head-view").scrollIntoView({ block: "nearest" });
  };

  function setHeads(on) {
    state.heads = state.heads.map(on);
    syncHeadToggles();
    Q.render();
  }

  function buildHeadToggles(n) {
    var box = $("head-toggles");
    box.textContent = "";
    Q.range(n).forEach(function (h) {
      var b = Q.html("button", { type: "button", "class": "head-toggle", "data-head": String(h), title: "head " + h },
                     box, String(h));
      b.style.setProperty("--c", Q.headColor(h, n));
      b.addEventListener("click", function () {
        setHeads(function (on, i) { return i === h ? !on : on; });
      });
    });
    syncHeadToggles();
  }

  function syncHeadToggles() {
    Array.prototype.forEach.call($("head-toggles").querySelectorAll(".head-toggle"), function (b) {
      b.setAttribute("aria-pressed", state.heads[Number(b.dataset.head)] ? "true" : "false");
    });
  }

  function wireControls() {
    $("example-select").addEventListener("change", function (e) { Q.setExample(Number(e.target.value)); });
    $("view-select").addEventListener("change", function (e) { Q.setView(Number(e.target.value)); });
    $("layer-select").addEventListener("change", function (e) { Q.setLayer(Number(e.target.value)); });
    $("heads-all").addEventListener("click", function () { setHeads(function () { return true; }); });
    $("heads-none").addEventListener("click", function () { setHeads(function () { return false; }); });
    $("summary-corpus").addEventListener("change", function () { Q.render(); });
    $("compare-sort").addEventListener("change", function (e) { Q.sortCompare(Number(e.target.value)); });
    Array.prototype.forEach.call(document.querySelectorAll("#tabs button"), function (button) {
      button.addEventListener("click", function () { Q.setTab(button.dataset.tab); });
    });
    Q.wireSaveButtons();
  }

  function wireLive() {
    var live = Q.live;
    var form = $("live-form");
    form.hidden = false;
    var input = $("live-text");
    var second = $("live-compare");
    input.maxLength = live.max_chars;
    second.maxLength = live.max_chars;
    Q.setOptions($("live-model"), live.models, 0);
    form.addEventListener("submit", function (event) {
      event.preventDefault();
      $("live-status").textContent = "running...";
      $("live-submit").disabled = true;
      var request = { text: input.value, model: live.models[Number($("live-model").value)] };
      if (second.value.trim()) { request.compare = second.value; }
      var body = JSON.stringify(request);
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
          return Q.unpackExamples(payload.examples || [payload.example]).then(function () { return payload; });
        })
        .then(function (payload) {
          Q.hideError();
          var first = Q.data.examples.length;
          (payload.examples || [payload.example]).forEach(function (e) { Q.data.examples.push(e); });
          if (payload.compare) {  // its example indices count from this answer's first example
            Q.setCompare(Object.assign({}, payload.compare, {
              examples: payload.compare.examples.map(function (i) { return first + i; })
            }));
            Q.state.tab = "compare";
          }
          $("controls").hidden = false;
          Q.setExample(first);
        })
        .catch(function (err) { Q.showError(err.message); })
        .then(function () {
          $("live-status").textContent = "";
          $("live-submit").disabled = false;
        });
    });
  }

  /* Where the page opens (qkv.viz.notebook's head_view / model_view write data.start): the model
   * view above the head view, the layer shown, the heads switched on. */
  function applyStart(start) {
    if (!start || !Q.data.examples.length) { return; }
    var view = Q.data.examples[0].views[0];
    if (start.panel === "model-view") { $("head-view").parentNode.insertBefore($("model-view"), $("head-view")); }
    if (typeof start.layer === "number") { state.layer = Math.max(0, Math.min(view.layers - 1, start.layer)); }
    if (Array.isArray(start.heads)) {
      state.heads = Q.range(view.heads).map(function (h) { return start.heads.indexOf(h) >= 0; });
    }
  }

  document.title = Q.data.title || document.title;
  $("title").textContent = Q.data.title || "qkv attention explorer";
  wireControls();
  if (Q.live) { wireLive(); }
  Q.ready.then(function () {
    if (Q.data.examples.length) {
      applyStart(Q.data.start);
      Q.setExample(0);
    } else {
      $("controls").hidden = true;
      $("tabs").hidden = true;
      document.body.dataset.renders = "0";
    }
  }).catch(function (err) { Q.showError("cannot read the page's data: " + err.message); });
})(window.qkvExplorer);
