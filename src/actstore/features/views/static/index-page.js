/* actstore view, index: every feature as a virtual list (only the visible rows are in the
   page), sorted by any column, filtered by text, feature id or conditions (density<0.01). */
(function () {
  var A = window.ACTSTORE, M = A.meta, X = A.index, n = X.feature.length;
  var ROW = 26, neg = !!X.min;
  var cols = [
    {k: "feature", name: "feature", w: "72px", f: function (i) { return X.feature[i]; }},
    {k: "max", name: "max", w: "78px", f: function (i) { return A.g(X.max[i]); }},
  ];
  if (neg) { cols.push({k: "min", name: "min", w: "78px", f: function (i) { return A.g(X.min[i]); }}); }
  cols.push({k: "density", name: "density", w: "80px", f: function (i) { return A.pct(X.density[i]); }});
  if (neg) { cols.push({k: "density_neg", name: "density < 0", w: "86px", f: function (i) { return A.pct(X.density_neg[i]); }}); }
  cols.push({k: "mean", name: "mean active", w: "86px", f: function (i) { return A.g(X.mean[i]); }});
  cols.push({k: "n_active", name: "active", w: "80px", f: function (i) { return A.int(X.n_active[i]); }});
  cols.push({k: "text", name: M.image ? "top activation: image and patch (row, column)" : "top activation in context", w: "minmax(0, 1fr)", f: function (i) {
    var t = X.text[i]; return '<span class="tk">' + A.line(t[0]) + "</span><mark>" + A.line(t[1]) + '</mark><span class="tk">' + A.line(t[2]) + "</span>"; }});
  document.documentElement.style.setProperty("--cols", cols.map(function (c) { return c.w; }).join(" "));
  document.title = M.title;
  document.getElementById("title").textContent = M.title;
  var enc = M.encoder || {};
  document.getElementById("about").innerHTML = A.esc("store " + M.store + " (manifest " + String(M.store_sha256 || "").slice(0, 12) + "), layer " + M.layer +
    ", " + [enc.kind, enc.path].filter(Boolean).join(" ") + ", top-" + M.k + ", " + (M.sign || "positive") + " tail" + (M.sign === "both" ? "s" : "")) +
    (M.plots ? ' &middot; <a href="plots/plots.html">token norm plots</a>' : "");
  if (M.note) { document.getElementById("note").innerHTML = '<span class="note">' + A.esc(M.note) + "</span>"; }

  // summary: dead and dense features, and the density histogram
  var dead = 0, dense = 0, i, bins = new Array(9).fill(0);
  for (i = 0; i < n; i++) {
    var d = X.density[i];
    if (X.n_active[i] === 0) { dead++; } else {
      if (d > M.dense) { dense++; }
      bins[Math.max(0, Math.min(8, Math.floor(Math.log10(d)) + 8))]++;
    }
  }
  function card(v, label) { return '<div class="card"><b>' + v + "</b><span>" + label + "</span></div>"; }
  document.getElementById("cards").innerHTML = card(A.int(n), "features") + card(A.int(M.n_tokens || 0), "tokens read") +
    card(A.int(dead), "dead (never active)") + card(A.int(dense), "dense (active on > " + A.pct(M.dense) + ")") + quality(M.quality);
  function quality(q) {  // an SAE's reconstruction over the pass's tokens (meta.json's quality)
    if (!q || !q.n_tokens) { return ""; }
    var f = function (v, d) { return v === null || v === undefined ? "n/a" : Number(v).toFixed(d); };
    return card(f(q.fve, 4), "variance explained") + card(Number(q.mse).toPrecision(4), "MSE") + card(f(q.l0, 2), "L0") +
      ("ce_loss_score" in q ? card(f(q.ce_loss_score, 4), "CE loss recovered (" + A.int(q.ce_tokens) + " tokens)") : "");
  }
  var labels = ["dead"], counts = [dead], colours = ["#98a2b3"];
  for (i = 0; i < 9; i++) { labels.push("1e" + (i - 8) + " to 1e" + (i - 7)); counts.push(bins[i]); colours.push(i - 8 >= Math.log10(M.dense) ? "#b42318" : "#f79009"); }
  var svg = A.bars(counts, labels, colours, 360, 70);
  for (i = 0; i < 10; i += 1) {
    svg.push('<text x="' + ((i + 0.5) * 36).toFixed(0) + '" y="82" font-size="9" text-anchor="middle">' + (i === 0 ? "dead" : "e" + (i - 9)) + "</text>");
  }
  document.getElementById("dens").innerHTML = svg.join("") + "</svg>";

  // sorting and filtering over index arrays
  var order = new Int32Array(n), shown = order, key = "feature", asc = true;
  for (i = 0; i < n; i++) { order[i] = i; }
  var head = document.getElementById("head");
  head.innerHTML = cols.map(function (c) { return '<div data-k="' + c.k + '"' + (c.k === "text" ? "" : ' class="num"') + ">" + c.name + "</div>"; }).join("");
  function value(k, i) { if (k === "text") { return (X.text[i][1] + " " + X.text[i][0]).toLowerCase(); } return X[k][i]; }
  function sort() {
    var arr = Array.prototype.slice.call(shown), k = key, s = asc ? 1 : -1;
    arr.sort(function (a, b) { var x = value(k, a), y = value(k, b); return (x < y ? -s : x > y ? s : X.feature[a] - X.feature[b]); });
    shown = Int32Array.from(arr);
    head.querySelectorAll("div").forEach(function (d) { d.className = (d.dataset.k === "text" ? "" : "num") + (d.dataset.k === key ? " on" + (asc ? " asc" : "") : ""); });
  }
  head.onclick = function (e) {
    var k = e.target.dataset.k; if (!k) { return; }
    asc = k === key ? !asc : (k === "feature" || k === "text" || k === "min"); key = k; sort(); draw(true);
  };
  var OPS = {"<": function (a, b) { return a < b; }, ">": function (a, b) { return a > b; }, "<=": function (a, b) { return a <= b; },
    ">=": function (a, b) { return a >= b; }, "=": function (a, b) { return a === b; }};
  var PERCENT = {density: 1, density_neg: 1};
  function filter(q) {
    var tests = [];
    q.trim().toLowerCase().split(/\s+/).filter(Boolean).forEach(function (w) {
      var m = /^([a-z_]+)(<=|>=|<|>|=)(-?[\d.]+(?:e-?\d+)?)$/.exec(w);
      if (m && X[m[1]] && m[1] !== "text") {
        var col = X[m[1]], op = OPS[m[2]], v = parseFloat(m[3]) / (PERCENT[m[1]] ? 100 : 1);
        tests.push(function (i) { return op(col[i], v); });
      } else if (/^\d+$/.test(w)) {
        var id = +w; tests.push(function (i) { return X.feature[i] === id || (X.text[i].join("").toLowerCase().indexOf(w) >= 0); });
      } else {
        tests.push(function (i) { return X.text[i].join("").toLowerCase().indexOf(w) >= 0; });
      }
    });
    if (!tests.length) { return order; }
    var out = [];
    for (var i = 0; i < n; i++) { if (tests.every(function (t) { return t(i); })) { out.push(i); } }
    return Int32Array.from(out);
  }
  var scroll = document.getElementById("scroll"), spacer = document.getElementById("spacer"), drawn = "";
  function draw(reset) {
    if (reset) { scroll.scrollTop = 0; drawn = ""; }
    spacer.style.height = (shown.length * ROW) + "px";
    var first = Math.max(0, Math.floor(scroll.scrollTop / ROW) - 8), last = Math.min(shown.length, first + Math.ceil(scroll.clientHeight / ROW) + 16);
    var sig = first + ":" + last + ":" + shown.length;
    if (sig === drawn) { return; }
    drawn = sig;
    var html = [];
    for (var r = first; r < last; r++) {
      var i = shown[r];
      html.push('<a class="vrow" style="top:' + (r * ROW) + 'px" href="feature.html#' + X.feature[i] + '">' +
        cols.map(function (c) { return "<div" + (c.k === "text" ? ' class="snip"' : ' class="num"') + ">" + c.f(i) + "</div>"; }).join("") + "</a>");
    }
    spacer.innerHTML = html.join("");
    var count = document.getElementById("count");
    count.textContent = A.int(shown.length) + " of " + A.int(n) + " features";
    if (!count.dataset.ms) { count.dataset.ms = Math.round(performance.now()); }  // navigation to first draw
  }
  scroll.addEventListener("scroll", function () { draw(false); }, {passive: true});
  window.addEventListener("resize", function () { drawn = ""; draw(false); });
  var timer = null;
  document.getElementById("q").oninput = function () {
    var q = this.value; clearTimeout(timer);
    timer = setTimeout(function () { shown = filter(q); if (key !== "feature" || !asc) { sort(); } draw(true); }, 120);
  };
  // index.html#q=<search>&sort=<column> (-<column>: descending): a link to a view of the index
  var params = {};
  location.hash.slice(1).split("&").forEach(function (kv) { var i = kv.indexOf("="); if (i > 0) { params[kv.slice(0, i)] = decodeURIComponent(kv.slice(i + 1)); } });
  if (params.q) { document.getElementById("q").value = params.q; shown = filter(params.q); }
  if (params.sort) { asc = params.sort.charAt(0) !== "-"; key = params.sort.replace(/^-/, ""); if (!X[key]) { key = "feature"; asc = true; } }
  sort();
  draw(true);
}());
