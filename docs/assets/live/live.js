/* qkv's live documentation page (docs/live.md): attention computed in the reader's browser.
 *
 * Part 1 runs a small qkv language model, exported by qkv.export.onnx_attention with its attention
 * weights as outputs, in ONNX Runtime Web (WebAssembly, one thread): the text typed is read one
 * character a token, and each layer's and head's causal self-attention is drawn as a heatmap.
 * Part 2 works scaled dot-product attention by hand on qkv explain's numbers, in float64, redrawn
 * whenever an input is edited.
 *
 * Everything comes from the scripts loaded before this one (docs_hooks/qkv_live.py writes them):
 * window.ort and QKV_ORT / QKV_ORT_WASM_GZ (or QKV_ORT_MISSING), QKV_LIVE_MODEL, QKV_EXPLAIN. Nothing is
 * fetched, so the page works from a local folder (file://) and offline. What is drawn is kept in
 * window.qkvLive (the tests read it there).
 */
(function () {
  "use strict";

  const live = (window.qkvLive = { ready: false, error: null, result: null, runs: 0, byHand: null });
  const $ = (id) => document.getElementById(id);

  function bytesOf(base64) {
    const text = atob(base64);
    const bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    return bytes;
  }

  async function gunzip(bytes) {
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return new Uint8Array(await new Response(stream).arrayBuffer());
  }

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  /* ------------------------------------------------------------------ part 1: the model */

  const VISIBLE = { " ": "\u2423", "\n": "\u23ce", "\t": "\u21e5" }; // ␣ ⏎ ⇥, as qkv attend labels them

  let session = null;
  let manifest = null;
  let vocab = null; // character -> id
  let selected = { layer: 0, head: 0 };

  function setStatus(text, isError) {
    const node = $("qkv-live-status");
    if (!node) return;
    node.textContent = text;
    node.classList.toggle("qkv-live-error", !!isError);
  }

  async function startModel() {
    if (window.QKV_ORT_MISSING) throw new Error(window.QKV_ORT_MISSING);
    if (!window.ort || !window.QKV_ORT || !window.QKV_LIVE_MODEL) throw new Error("the page's bundles did not load");
    const ort = window.ort;
    ort.env.wasm.numThreads = 1; // threads need cross-origin isolation, which a file:// page lacks
    ort.env.wasm.proxy = false;
    ort.env.wasm.wasmBinary = await gunzip(bytesOf(window.QKV_ORT_WASM_GZ));
    ort.env.wasm.wasmPaths = { mjs: "data:text/javascript;base64," + window.QKV_ORT.loader };
    manifest = window.QKV_LIVE_MODEL.manifest;
    vocab = new Map(Array.from(manifest.chars).map((c, i) => [c, i]));
    session = await ort.InferenceSession.create(bytesOf(window.QKV_LIVE_MODEL.graph), {
      executionProviders: ["wasm"],
    });
  }

  /** The ids of text, one per character; the last `context` of them, as qkv attend keeps. */
  function encode(text) {
    const chars = Array.from(text);
    const missing = [...new Set(chars.filter((c) => !vocab.has(c)))];
    if (missing.length) {
      const shown = missing.slice(0, 10).map((c) => JSON.stringify(c)).join(", ");
      throw new Error(`${missing.length} character${missing.length === 1 ? "" : "s"} not in the model's ` +
        `vocabulary of ${vocab.size}: ${shown}`);
    }
    if (!chars.length) throw new Error("type some text");
    const context = manifest.model.context;
    const kept = chars.slice(-context);
    return { chars: kept, ids: kept.map((c) => vocab.get(c)), cropped: chars.length - kept.length };
  }

  async function runModel(text) {
    const { chars, ids, cropped } = encode(text);
    const ort = window.ort;
    const input = new ort.Tensor("int64", BigInt64Array.from(ids.map((i) => BigInt(i))), [1, ids.length]);
    const out = await session.run({ [manifest.inputs[0]]: input });
    const s = ids.length;
    const heads = manifest.model.num_heads;
    const attentions = manifest.outputs.slice(1).map((name) => {
      const data = out[name].data; // (1, h, s, s), row-major
      return Array.from({ length: heads }, (_, h) =>
        Array.from({ length: s }, (_, q) => Array.from(data.subarray((h * s + q) * s, (h * s + q + 1) * s))));
    });
    const logits = Array.from(out[manifest.outputs[0]].data);
    const top = Math.max(...logits);
    const exps = logits.map((v) => Math.exp(v - top));
    const total = exps.reduce((a, b) => a + b, 0);
    const next = exps.map((e, i) => [manifest.chars[i], e / total]).sort((a, b) => b[1] - a[1]).slice(0, 5);
    live.result = { text, tokens: chars, ids, cropped, attentions, next };
    live.runs += 1;
    draw();
  }

  function label(c) {
    return VISIBLE[c] || c;
  }

  function heat(value) {
    const v = Math.max(0, Math.min(1, value));
    const light = Math.round(255 - 205 * Math.sqrt(v)); // small weights stay visible
    return `rgb(${light}, ${Math.round(light * 0.9 + 20)}, 255)`;
  }

  function drawHeatmap(canvas, matrix, cell) {
    const s = matrix.length;
    canvas.width = s * cell;
    canvas.height = s * cell;
    const ctx = canvas.getContext("2d");
    for (let q = 0; q < s; q++) {
      for (let k = 0; k < s; k++) {
        ctx.fillStyle = heat(matrix[q][k]);
        ctx.fillRect(k * cell, q * cell, cell, cell);
      }
    }
  }

  function draw() {
    const r = live.result;
    if (!r) return;
    const layers = r.attentions.length;
    const heads = r.attentions[0].length;
    const grid = $("qkv-live-heads");
    grid.replaceChildren();
    for (let l = 0; l < layers; l++) {
      const row = el("div", { class: "qkv-live-row" });
      row.appendChild(el("span", { class: "qkv-live-rowname" }, `layer ${l}`));
      for (let h = 0; h < heads; h++) {
        const canvas = el("canvas", {
          class: "qkv-live-thumb" + (l === selected.layer && h === selected.head ? " qkv-live-selected" : ""),
          title: `layer ${l}, head ${h}: click to enlarge`,
          "data-layer": l,
          "data-head": h,
        });
        drawHeatmap(canvas, r.attentions[l][h], 2);
        canvas.addEventListener("click", () => {
          selected = { layer: l, head: h };
          draw();
        });
        row.appendChild(canvas);
      }
      grid.appendChild(row);
    }
    const matrix = r.attentions[selected.layer][selected.head];
    $("qkv-live-which").textContent = `layer ${selected.layer}, head ${selected.head}`;
    const big = $("qkv-live-map");
    const cell = Math.max(4, Math.min(12, Math.floor(520 / r.tokens.length)));
    drawHeatmap(big, matrix, cell);
    big.onmousemove = (event) => {
      const box = big.getBoundingClientRect();
      const k = Math.floor(((event.clientX - box.left) / box.width) * r.tokens.length);
      const q = Math.floor(((event.clientY - box.top) / box.height) * r.tokens.length);
      if (q >= 0 && k >= 0 && q < r.tokens.length && k < r.tokens.length) showCell(q, k);
    };
    drawText(matrix, r.tokens.length - 1);
    const notes = [];
    if (r.cropped) notes.push(`showing the last ${r.tokens.length} characters (the model's context)`);
    $("qkv-live-next").textContent =
      "most likely next characters: " + r.next.map(([c, p]) => `${label(c)} ${p.toFixed(3)}`).join(", ") +
      (notes.length ? ` (${notes.join("; ")})` : "");
  }

  function showCell(q, k) {
    const r = live.result;
    const w = r.attentions[selected.layer][selected.head][q][k];
    $("qkv-live-cell").textContent =
      `query ${q} "${label(r.tokens[q])}" \u2192 key ${k} "${label(r.tokens[k])}": ${w.toFixed(4)}`;
    drawText(r.attentions[selected.layer][selected.head], q);
  }

  /** The text, each character shaded by how much the query character attends to it. */
  function drawText(matrix, q) {
    const r = live.result;
    const box = $("qkv-live-text");
    box.replaceChildren();
    r.tokens.forEach((c, k) => {
      const span = el("span", { class: "qkv-live-char" + (k === q ? " qkv-live-query" : "") }, label(c));
      span.style.background = k <= q ? heat(matrix[q][k]) : "transparent";
      span.title = `${matrix[q][k].toFixed(4)}`;
      span.addEventListener("mouseenter", () => showCell(k, Math.min(k, q)));
      box.appendChild(span);
    });
  }

  async function onText() {
    const text = $("qkv-live-input").value;
    try {
      await runModel(text);
      setStatus(`ran ${live.result.ids.length} characters through the model in your browser ` +
        `(ONNX Runtime Web ${window.QKV_ORT.version}, WebAssembly)`);
    } catch (err) {
      setStatus(String(err.message || err), true);
    }
  }

  async function initModel() {
    if (!$("qkv-live-input")) return;
    setStatus("loading ONNX Runtime Web and the model\u2026");
    try {
      await startModel();
    } catch (err) {
      live.error = String(err.message || err);
      setStatus(`the model could not start: ${live.error}`, true);
      return;
    }
    live.ready = true;
    let timer = null;
    $("qkv-live-input").addEventListener("input", () => {
      clearTimeout(timer);
      timer = setTimeout(onText, 150);
    });
    await onText();
  }

  /* ------------------------------------------------------------------ part 2: by hand */

  const MATRICES = ["x", "w_q", "w_k", "w_v"];

  function matmul(a, b) {
    return a.map((row) => b[0].map((_, j) => row.reduce((sum, v, k) => sum + v * b[k][j], 0)));
  }

  const transpose = (m) => m[0].map((_, j) => m.map((row) => row[j]));

  /** Every step of softmax(Q K^T / sqrt(d_k)) V for inputs {x, w_q, w_k, w_v}, in float64. */
  function attendByHand(m) {
    const q = matmul(m.x, m.w_q);
    const k = matmul(m.x, m.w_k);
    const v = matmul(m.x, m.w_v);
    const dk = m.w_q[0].length;
    const scores = matmul(q, transpose(k));
    const scaled = scores.map((row) => row.map((s) => s / Math.sqrt(dk)));
    const exps = scaled.map((row) => {
      const top = Math.max(...row);
      return row.map((s) => Math.exp(s - top));
    });
    const sums = exps.map((row) => [row.reduce((a, b) => a + b, 0)]);
    const weights = exps.map((row, i) => row.map((e) => e / sums[i][0]));
    const z = matmul(weights, v);
    return { q, k, v, scores, scaled, exps, sums, weights, z, dk };
  }

  const fmt = (v) => v.toFixed(3);

  function table(name, m, rows, cols, editable) {
    const wrap = el("div", { class: "qkv-hand-matrix" });
    wrap.appendChild(el("div", { class: "qkv-hand-title" }, `${name}  (${m.length} \u00d7 ${m[0].length})`));
    const t = el("table", { class: "qkv-hand-table", "data-matrix": name });
    const head = el("tr");
    head.appendChild(el("th"));
    cols.forEach((c) => head.appendChild(el("th", {}, c)));
    t.appendChild(head);
    m.forEach((row, i) => {
      const tr = el("tr");
      tr.appendChild(el("th", {}, rows[i]));
      row.forEach((v, j) => {
        const td = el("td", { "data-i": i, "data-j": j, "data-v": String(v) });
        if (editable) {
          const input = el("input", { type: "number", step: "any", value: String(v), "aria-label": `${name}[${i}, ${j}]` });
          input.addEventListener("input", () => {
            const value = parseFloat(input.value);
            if (Number.isFinite(value)) {
              live.byHand.inputs[editable][i][j] = value;
              td.setAttribute("data-v", String(value));
              renderByHand();
            }
          });
          td.appendChild(input);
        } else {
          td.textContent = fmt(v);
        }
        tr.appendChild(td);
      });
      t.appendChild(tr);
    });
    wrap.appendChild(t);
    return wrap;
  }

  const labels = (prefix, n) => Array.from({ length: n }, (_, i) => `${prefix}${i}`);

  function renderInputs() {
    const m = live.byHand.inputs;
    const n = m.x.length;
    const d = m.x[0].length;
    const dk = m.w_q[0].length;
    const box = $("qkv-hand-inputs");
    box.replaceChildren();
    box.appendChild(table("X", m.x, labels("t", n), labels("f", d), "x"));
    for (const [name, key] of [["W_Q", "w_q"], ["W_K", "w_k"], ["W_V", "w_v"]]) {
      box.appendChild(table(name, m[key], labels("f", d), labels("k", dk), key));
    }
  }

  function step(box, text) {
    box.appendChild(el("p", { class: "qkv-hand-step" }, text));
  }

  function renderByHand() {
    const m = live.byHand.inputs;
    const r = attendByHand(m);
    live.byHand.result = r;
    const n = m.x.length;
    const toks = labels("t", n);
    const kd = labels("k", r.dk);
    const box = $("qkv-hand-steps");
    box.replaceChildren();
    step(box, "Step 3. Queries, keys and values: Q = X W_Q, K = X W_K, V = X W_V (one row per token).");
    const qkv = el("div", { class: "qkv-hand-group" });
    [["Q", r.q], ["K", r.k], ["V", r.v]].forEach(([name, mat]) => qkv.appendChild(table(name, mat, toks, kd)));
    box.appendChild(qkv);
    const j = Math.min(1, n - 1);
    const terms = r.q[0].map((a, i) => `(${fmt(a)})(${fmt(r.k[j][i])})`).join(" + ");
    step(box, `Step 4. Scores S = Q K^T: S[i, j] = q_i \u00b7 k_j, how well query i matches key j. ` +
      `For example S[0, ${j}] = ${terms} = ${fmt(r.scores[0][j])}.`);
    box.appendChild(table("S = Q K^T", r.scores, toks, toks));
    step(box, `Step 5. Divide by \u221ad_k = \u221a${r.dk} = ${fmt(Math.sqrt(r.dk))}, so that the scores do ` +
      "not grow with d_k.");
    box.appendChild(table("S / sqrt(d_k)", r.scaled, toks, toks));
    step(box, "Step 6. Softmax over each row: subtract the row's largest score, exponentiate, divide by the " +
      "row's sum. Each row of A sums to 1.");
    const soft = el("div", { class: "qkv-hand-group" });
    soft.appendChild(table("exp(S / sqrt(d_k) - row max)", r.exps, toks, toks));
    soft.appendChild(table("row sums", r.sums, toks, ["sum"]));
    soft.appendChild(table("A = softmax(S / sqrt(d_k))", r.weights, toks, toks));
    box.appendChild(soft);
    step(box, "Step 7. The output: each token's new vector is the A-weighted average of the values, Z = A V.");
    box.appendChild(table("Z = A V", r.z, toks, kd));
  }

  function resetByHand() {
    const e = window.QKV_EXPLAIN;
    live.byHand = { inputs: Object.fromEntries(MATRICES.map((k) => [k, e[k].map((row) => row.slice())])) };
    renderInputs();
    renderByHand();
  }

  function initByHand() {
    if (!$("qkv-hand-inputs")) return;
    if (!window.QKV_EXPLAIN) {
      $("qkv-hand-inputs").textContent = "the example's numbers did not load (explain.js)";
      return;
    }
    $("qkv-hand-reset").addEventListener("click", resetByHand);
    resetByHand();
  }

  function init() {
    initByHand();
    initModel();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
