"use strict";
// The heads page: draws everything from the JSON in #headwise-data (no network, no libraries).
(function () {
  const data = JSON.parse(document.getElementById("headwise-data").textContent);
  const L = data.layers, H = data.heads, T = data.tokens.length;

  // Float32 little-endian, base64 -> Float32Array.
  function floats(b64) {
    const bin = atob(b64);
    const view = new DataView(new ArrayBuffer(bin.length));
    for (let i = 0; i < bin.length; i++) view.setUint8(i, bin.charCodeAt(i));
    const out = new Float32Array(bin.length / 4);
    for (let i = 0; i < out.length; i++) out[i] = view.getFloat32(4 * i, true);
    return out;
  }
  const W = floats(data.weights.float32);
  function weights(layer, head) { const n = T * T, at = (layer * H + head) * n; return W.subarray(at, at + n); }
  function role(layer, head) { return data.roles[layer * H + head]; }

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  // 0 -> white, 1 -> deep blue.
  function blue(v) {
    const t = Math.max(0, Math.min(1, v));
    return [Math.round(255 - t * 247), Math.round(255 - t * 207), Math.round(255 - t * 148)];
  }
  // Signed values scaled by m: negative -> blue, positive -> red.
  function diverging(v, m) {
    const t = m > 0 ? Math.max(-1, Math.min(1, v / m)) : 0;
    const [r, g, b] = t >= 0 ? [202, 0, 32] : [5, 113, 176], a = Math.abs(t);
    return [Math.round(255 + (r - 255) * a), Math.round(255 + (g - 255) * a), Math.round(255 + (b - 255) * a)];
  }
  function paint(canvas, values, n) {
    canvas.width = n; canvas.height = n;
    const ctx = canvas.getContext("2d"), img = ctx.createImageData(n, n);
    for (let i = 0; i < n * n; i++) {
      const [r, g, b] = blue(values[i]);
      img.data[4 * i] = r; img.data[4 * i + 1] = g; img.data[4 * i + 2] = b; img.data[4 * i + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
  }
  const fmt = (v) => v.toFixed(4);

  // ---- header, legend, views ----
  document.getElementById("title").textContent = "Attention heads of " + data.model;
  document.title = "headwise: " + data.model + " heads";
  document.getElementById("sentence").textContent =
    "\u201c" + data.text + "\u201d: " + T + " tokens, " + L + " layers \u00d7 " + H + " heads" +
    (data.causal ? " (causal: each token sees itself and the tokens before it)" : " (bidirectional)");
  document.getElementById("footer").textContent =
    "Made by headwise " + data.version + " (headwise heads). Weights: headwise.attention_weights on the queries and keys " +
    "observed in one forward pass. Roles: mean weight over the sentence's words (not [CLS]/[SEP]).";
  const legend = document.getElementById("legend");
  for (const [name, colour] of Object.entries(data.colours)) {
    const count = data.roles.filter((r) => r.role === name).length;
    const li = el("li", { "data-role": name });
    const sw = el("span", { class: "swatch" }); sw.style.background = colour;
    li.append(sw, el("span", {}, name + " (" + count + ")"));
    legend.append(li);
  }
  function show(view) {
    for (const b of document.querySelectorAll("nav button")) b.setAttribute("aria-pressed", String(b.dataset.view === view));
    document.getElementById("heads-view").hidden = view !== "heads";
    document.getElementById("steps-view").hidden = view !== "steps";
  }
  for (const b of document.querySelectorAll("nav button")) b.addEventListener("click", () => show(b.dataset.view));

  // ---- the grid ----
  const grid = document.getElementById("grid");
  grid.style.gridTemplateColumns = "auto repeat(" + H + ", auto)";
  grid.append(el("div", { class: "axis" }));
  for (let h = 0; h < H; h++) grid.append(el("div", { class: "axis" }, "head " + h));
  const cells = [];
  for (let l = 0; l < L; l++) {
    grid.append(el("div", { class: "axis layer" }, "layer " + l));
    for (let h = 0; h < H; h++) {
      const r = role(l, h);
      const cell = el("button", { type: "button", class: "cell", "data-head": l + "." + h, "data-role": r.role, "aria-pressed": "false",
        title: "layer " + l + ", head " + h + ": " + r.role + " " + r.share.toFixed(2) });
      cell.style.borderColor = data.colours[r.role];
      const canvas = el("canvas");
      paint(canvas, weights(l, h), T);
      cell.append(canvas, el("span", { class: "role" }, (r.role === "mixed" ? "mixed" : r.role.replace("[CLS]/[SEP]", "CLS/SEP")) + " " + r.share.toFixed(2)));
      cell.addEventListener("click", () => select(l, h));
      grid.append(cell);
      cells.push(cell);
    }
  }

  // ---- the detail ----
  const canvas = document.getElementById("detail-canvas"), plot = document.getElementById("plot");
  const xlabels = document.getElementById("xlabels"), ylabels = document.getElementById("ylabels");
  const rowmark = document.getElementById("rowmark"), colmark = document.getElementById("colmark");
  const readout = document.getElementById("detail-value");
  const size = Math.max(16, Math.min(40, Math.floor(520 / T)));
  canvas.style.width = canvas.style.height = T * size + "px";
  for (const [box, horizontal] of [[xlabels, true], [ylabels, false]]) {
    data.tokens.forEach((tok, i) => {
      const s = el("span", { "data-token": String(i) }, tok);
      if (horizontal) s.style.width = s.style.lineHeight = size + "px"; else s.style.height = size + "px";
      box.append(s);
    });
  }
  let current = [0, 0];
  function select(l, h) {
    l = Math.max(0, Math.min(L - 1, l)); h = Math.max(0, Math.min(H - 1, h));
    current = [l, h];
    cells.forEach((c, i) => c.setAttribute("aria-pressed", String(i === l * H + h)));
    const r = role(l, h);
    document.getElementById("detail").dataset.shown = l + "." + h;
    document.getElementById("detail-title").textContent = "Layer " + l + ", head " + h + ": " + r.role +
      (r.role === "mixed" ? " (no kind of key gets half of the weight)" : " (" + r.share.toFixed(2) + " of the weight)");
    document.getElementById("detail-mass").textContent = data.kinds.map((k, i) => k + " " + r.mass[i].toFixed(2)).join(" \u00b7 ");
    paint(canvas, weights(l, h), T);
    canvas.style.outline = "3px solid " + data.colours[r.role];
    hover(null);
    return cells[l * H + h];
  }
  function hover(at) {
    for (const s of document.querySelectorAll("#detail-map span.hot")) s.classList.remove("hot");
    if (!at) { rowmark.style.display = colmark.style.display = "none"; return; }
    const [i, j] = at;
    rowmark.style.display = colmark.style.display = "block";
    rowmark.style.top = i * size + "px"; rowmark.style.height = size + "px";
    colmark.style.left = j * size + "px"; colmark.style.width = size + "px";
    ylabels.children[i].classList.add("hot"); xlabels.children[j].classList.add("hot");
    const v = weights(current[0], current[1])[i * T + j];
    readout.textContent = "query \u201c" + data.tokens[i] + "\u201d (" + i + ") \u2192 key \u201c" + data.tokens[j] + "\u201d (" + j + "): " + fmt(v);
    readout.dataset.value = String(v);
  }
  plot.addEventListener("mousemove", (e) => {
    const box = canvas.getBoundingClientRect();
    const i = Math.floor((e.clientY - box.top) / size), j = Math.floor((e.clientX - box.left) / size);
    hover(i >= 0 && i < T && j >= 0 && j < T ? [i, j] : null);
  });
  plot.addEventListener("mouseleave", () => hover(null));
  document.addEventListener("keydown", (e) => {
    if (document.getElementById("heads-view").hidden) return;
    const step = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] }[e.key];
    if (!step) return;
    e.preventDefault();
    select(current[0] + step[0], current[1] + step[1]).focus();
  });

  // ---- the ten steps ----
  const S = data.steps;
  document.getElementById("steps-intro").textContent =
    S.module + ", seed " + S.seed + ", on the book's six tokens (" + S.tokens.join(" ") + "), batch of one: " +
    "the tensors of one real forward pass, as headwise explain prints them. Red = positive, blue = negative, " +
    "striped = \u2212\u221e (a masked key: the future, or another document); each tensor has its own scale.";
  function heat(values, rows, cols, rowNames, colNames, m) {
    const table = el("table", { class: "heat" });
    const head = el("tr"); head.append(el("th"));
    for (let j = 0; j < cols; j++) head.append(el("th", {}, colNames ? colNames[j] : String(j)));
    table.append(head);
    for (let i = 0; i < rows; i++) {
      const tr = el("tr"); tr.append(el("th", {}, rowNames ? rowNames[i] : String(i)));
      for (let j = 0; j < cols; j++) {
        const v = values[i * cols + j];
        const td = el("td", { "data-value": String(v) }, v === -Infinity ? "\u2212\u221e" : v.toFixed(4));
        if (v === -Infinity) td.className = "neginf";
        else { const [r, g, b] = diverging(v, m); td.style.background = "rgb(" + r + "," + g + "," + b + ")"; if (Math.abs(v) > 0.6 * m) td.style.color = "#fff"; }
        tr.append(td);
      }
      table.append(tr);
    }
    return table;
  }
  function names(axis, n) {
    if (axis === "num_tokens") return S.tokens.slice(0, n);
    return null;
  }
  function tensorFigure(t) {
    let shape = t.shape.slice(), axes = t.axes.slice();
    const values = floats(t.float32);
    const fig = el("figure", { "data-tensor": t.name });
    const cap = el("figcaption");
    cap.append(el("b", {}, t.name), document.createTextNode(" \u00b7 shape (" + t.shape.join(", ") + ") = (" + t.axes.join(", ") + ")"));
    fig.append(cap);
    if (axes[0] === "b" && shape[0] === 1) { shape = shape.slice(1); axes = axes.slice(1); }
    let m = 0;
    for (const v of values) if (Number.isFinite(v)) m = Math.max(m, Math.abs(v));
    const slices = el("div", { class: "slices" });
    const outer = shape.length === 3 ? shape[0] : 1, [rows, cols] = shape.slice(-2), n = rows * cols;
    for (let s = 0; s < outer; s++) {
      const box = el("div");
      if (shape.length === 3) {
        const label = axes[0] === "num_tokens" ? S.tokens[s] : axes[0] === "num_heads" ? "head " + s : axes[0] + " " + s;
        box.append(el("div", { class: "slice-name" }, label));
      }
      box.append(heat(values.subarray(s * n, s * n + n), rows, cols, names(axes[axes.length - 2], rows), names(axes[axes.length - 1], cols), m));
      slices.append(box);
    }
    fig.append(slices);
    return fig;
  }
  const stepsBox = document.getElementById("steps");
  for (const step of S.steps) {
    const art = el("article", { class: "step", "data-step": String(step.number) });
    art.append(el("h3", {}, "Step " + step.number + ": " + step.title));
    art.append(el("pre", {}, step.code));
    if (step.number === 2) art.append(el("p", {}, "d_out = " + S.facts.d_out + ", num_heads = " + S.facts.num_heads + ", head_dim = " + S.facts.head_dim));
    const tensors = el("div", { class: "tensors" });
    for (const t of step.tensors) tensors.append(tensorFigure(t));
    art.append(tensors);
    stepsBox.append(art);
  }
  // Step 8 again, one newer term at a time: what the cap, the sink, ALiBi and documents change.
  const variantsBox = document.getElementById("variants");
  for (const v of S.variants) {
    const art = el("article", { class: "step", "data-variant": v.name });
    art.append(el("h3", {}, "Step 8 with " + v.name + ": " + v.title), el("p", {}, v.about), el("pre", {}, v.code));
    const tensors = el("div", { class: "tensors" });
    for (const t of v.tensors) tensors.append(tensorFigure(t));
    art.append(tensors);
    variantsBox.append(art);
  }

  // #ten-steps opens the ten steps; #head=L.H opens that head.
  const wanted = /^#head=(\d+)\.(\d+)$/.exec(location.hash);
  select(wanted ? +wanted[1] : 0, wanted ? +wanted[2] : 0);
  if (location.hash === "#ten-steps") show("steps");
  // For tests and embedding: the data, the decoded weights of a head, the head shown.
  window.headwise = { data: data, weights: (l, h) => Array.from(weights(l, h)), select: select, current: () => current.slice(), show: show };
})();
