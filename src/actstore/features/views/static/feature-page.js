/* actstore view, one feature: feature.html#<id> loads data/f/<id / bucket>/<id>.js. */
(function () {
  var A = window.ACTSTORE, M = A.meta, V = A.vocab, page = document.getElementById("page");
  var text = V.text, ctx = V.ctx || {}, raw = {};
  (V.raw || []).forEach(function (p) { raw[p] = 1; });
  var PART = " (holds part of a character that shows on a later token)";
  if (M.note) { document.getElementById("note").innerHTML = '<span class="note">' + A.esc(M.note) + "</span>"; }
  var enc = M.encoder || {};
  document.getElementById("about").textContent = "layer " + M.layer + ", " + [enc.kind, enc.path].filter(Boolean).join(" ") +
    ", " + A.int(M.n_tokens || 0) + " tokens read" + (M.token_mask === "content" ? " (special and template tokens left out)" : "");
  function tok(p) { return p >= 0 && p < text.length ? text[p] : ""; }
  // a token inside a window: its piece of the window's decoded text (R.px where that is not
  // the vocabulary's text in context; actstore.inputs.tokentext cuts them)
  function piece(R, k, p) { return R.px_.hasOwnProperty(k) ? R.px_[k] : ctx.hasOwnProperty(p) ? ctx[p] : tok(p); }
  function card(v, label) { return '<div class="card"><b>' + v + "</b><span>" + label + "</span></div>"; }
  function hist(h, edges, colour, what) {
    if (!h) { return '<p class="meta">no ' + what + " values</p>"; }
    var first = h[0], counts = h[1], labels = [];
    for (var i = 0; i < counts.length; i++) {
      var b = first + i, lo = b === 0 ? 0 : edges[b - 1], hi = b < edges.length ? edges[b] : Infinity;
      labels.push("[" + A.g(lo, 3) + ", " + A.g(hi, 3) + ")");
    }
    var svg = A.bars(counts, labels, colour, 440, 90);
    svg.push('<text x="0" y="104" font-size="10">' + A.g(first === 0 ? 0 : edges[first - 1], 3) + "</text>");
    svg.push('<text x="440" y="104" font-size="10" text-anchor="end">' + A.g(edges[Math.min(first + counts.length - 1, edges.length - 1)], 3) + "</text>");
    return svg.join("") + "</svg>";
  }
  function logitHist(L) {
    var lo = L.hist[0], hi = L.hist[1], counts = L.hist[2], n = counts.length, w = (hi - lo) / n, labels = [], colours = [];
    for (var i = 0; i < n; i++) { var a = lo + i * w; labels.push("[" + A.g(a, 3) + ", " + A.g(a + w, 3) + ")"); colours.push(a + w / 2 < 0 ? "rgb(" + "30,110,255" + ")" : "rgb(255,110,0)"); }
    var svg = A.bars(counts, labels, colours, 440, 90);
    svg.push('<text x="0" y="104" font-size="10">' + A.g(lo, 3) + '</text><text x="440" y="104" font-size="10" text-anchor="end">' + A.g(hi, 3) + "</text>");
    return svg.join("") + "</svg>";
  }
  function tokenTable(title, rows, valueName) {
    if (!rows || !rows.length) { return ""; }
    return "<h3>" + title + '</h3><table class="t"><tr><th>token</th><th class="num">' + valueName + "</th></tr>" + rows.map(function (r) {
      var b = raw[r[0]] ? ' raw" title="the bytes of part of a character (no whole character)' : "";
      return '<tr><td class="ctx"><span class="tk' + b + '">' + A.show(tok(r[0])) + '</span></td><td class="num">' + A.g(r[1]) + "</td></tr>"; }).join("") + "</table>";
  }
  function featureTable(title, rows, valueName, fmt) {
    if (!rows || !rows.length) { return ""; }
    return "<h3>" + title + '</h3><table class="t"><tr><th>feature</th><th class="num">' + valueName + "</th></tr>" + rows.map(function (r) {
      return '<tr><td><a href="#' + r[0] + '">' + r[0] + '</a></td><td class="num">' + fmt(r[1]) + "</td></tr>"; }).join("") + "</table>";
  }
  function context(R, r, ref) {
    var W = R.width, c = M.window[0], out = [];
    for (var i = 0; i < W; i++) {
      var p = R.v[r * W + i];
      if (p < 0) { continue; }
      var k = r * W + i, a = R.a[k] * R.scale, left = R.off_[k], part = R.part_[k];
      var alpha = left || !ref[a >= 0 ? 0 : 1] ? 0 : Math.min(1, Math.abs(a) / ref[a >= 0 ? 0 : 1]);
      var rgb = a >= 0 ? "255,110,0" : "30,110,255";
      out.push('<span class="tk' + (i === c ? " fire" : "") + (left ? " off" : "") + (part ? " part" : "") + '" style="background:rgba(' + rgb + "," + alpha.toFixed(2) +
        ')" title="' + A.g(a) + (left ? " (left out by the pass)" : "") + " \u00b7 id " + V.ids[p] + (part ? PART : "") + '">' + A.show(piece(R, k, p)) + "</span>");
    }
    return out.join("");
  }
  function where(R, r) {
    var rows = R.rows, s = "example " + rows.ex[r] + ", token " + rows.tok[r];
    if (rows.doc && rows.doc[r] >= 0) {
      s = '<span title="document key">' + A.esc(R.keys[rows.doc[r]]) + "</span>" + (rows.dt && rows.dt[r] >= 0 ? ", token " + rows.dt[r] : "") +
        '<br><span class="meta">example ' + rows.ex[r] + ", token " + rows.tok[r] + "</span>";
    }
    return s;
  }
  function groupTitle(g) {
    if (g.kind === "top") { return "Top activations"; }
    if (g.kind === "bottom") { return 'Most negative activations<span class="pill neg">negative tail</span>'; }
    return "Interval (" + A.g(g.lo, 3) + ", " + A.g(g.hi, 3) + "]" + (g.sign < 0 ? '<span class="pill neg">negative tail</span>' : "") +
      (g.exact ? "" : '<span class="pill" title="the pool held a share of the interval, not all of it">approximate sample</span>');
  }
  function render(R) {
    var S = R.stats, f = R.f, html = [];
    document.title = "feature " + f + " - " + M.title;
    document.getElementById("title").textContent = "Feature " + f;
    var C = R.cols || {};
    R.rows = {};
    ["g", "rank", "ex", "tok", "act", "doc", "dt", "im"].forEach(function (k) { if (C[k]) { R.rows[k] = A.unpack(C[k]); } });
    if (C.v) { R.v = A.unpack(C.v); R.a = A.unpack(C.a); }
    R.off_ = new Uint8Array(R.v ? R.v.length : 0);
    (R.off || []).forEach(function (i) { R.off_[i] = 1; });
    R.part_ = new Uint8Array(R.off_.length);
    (R.part || []).forEach(function (i) { R.part_[i] = 1; });
    R.px_ = {};
    (R.px || []).forEach(function (x) { R.px_[x[0]] = x[1]; });
    var cards = card(A.g(S.max), "max") + card(A.pct(S.density), "density (active &gt; 0)") + card(A.g(S.mean_active), "mean when active") +
      card(A.int(S.n_active) + " / " + A.int(S.n_tokens), "active tokens");
    if (S.min !== undefined) { cards += card(A.g(S.min), "min") + card(A.pct(S.density_negative), "density &lt; 0") + card(A.g(S.mean_negative), "mean when negative"); }
    html.push('<div class="cards">' + cards + "</div>");
    html.push('<div class="row2"><div><h2>Activation histogram (log bins, log counts)</h2>' + hist(R.hist, M.edges, "rgb(255,110,0)", "positive") + "</div>");
    if (R.hist_neg !== undefined) { html.push("<div><h2>Negative values (|x|, log bins)</h2>" + hist(R.hist_neg, M.edges_negative || M.edges, "rgb(30,110,255)", "negative") + "</div>"); }
    if (R.logits) {
      html.push("<div><h2>Logit effect of the decoder direction</h2>" + logitHist(R.logits) + "</div>");
    }
    html.push("</div>");
    var side = [];
    if (R.logits) { side.push("<div>" + tokenTable("Logits raised most", R.logits.pos, "logit") + "</div><div>" + tokenTable("Logits lowered most", R.logits.neg, "logit") + "</div>"); }
    side.push("<div>" + tokenTable("Tokens most often active (top and samples)", R.common, "count") + "</div>");
    side.push("<div>" + featureTable("Decoder-cosine neighbours", R.nb, "cosine", function (x) { return A.g(x, 3); }) + "</div>");
    side.push("<div>" + featureTable("Co-occurring at its top activations", R.co, "shared tokens", A.int) + "</div>");
    html.push('<div class="row2">' + side.join("") + "</div>");
    var ref = [S.max > 0 ? S.max : 0, S.min < 0 ? -S.min : 0];
    var groups = R.groups.map(function () { return []; });
    R.rows.g.forEach(function (g, r) { groups[g].push(r); });
    R.groups.forEach(function (g, gi) {
      html.push("<h2>" + groupTitle(g) + "</h2>");
      if (R.images) { html.push(A.vision.grid(R, groups[gi])); return; }
      html.push('<table class="t examples"><tr><th class="num">#</th><th class="num">activation</th><th>document</th><th>context</th></tr>');
      groups[gi].forEach(function (r) {
        html.push('<tr><td class="num">' + R.rows.rank[r] + '</td><td class="num">' + A.g(R.rows.act[r]) + '</td><td class="key">' + where(R, r) +
          '</td><td class="ctx">' + context(R, r, ref) + "</td></tr>");
      });
      html.push("</table>");
    });
    page.innerHTML = html.join("");
    if (R.images) { A.vision.draw(R, page, ref); }
    page.dataset.feature = f;
    page.dataset.ms = Math.round(performance.now());
    page.dataset.wide = document.documentElement.scrollWidth > window.innerWidth ? "1" : "0";  // no token widens the page
  }
  function go() {
    var f = parseInt((location.hash || "#0").slice(1), 10);
    if (!(f >= 0)) { f = 0; }
    document.getElementById("prev").href = "#" + Math.max(0, f - 1);
    document.getElementById("next").href = "#" + (f + 1);
    A.script(A.featurePath(f, M.bucket), "feature", function (R) { if (R.f === f) { render(R); window.scrollTo(0, 0); } }, function () {
      page.innerHTML = '<p class="note">feature ' + f + " is not in this site (" + A.int(M.n_features) + " features)</p>";
      page.dataset.feature = "";
    });
  }
  document.getElementById("goto").onchange = function () { location.hash = "#" + this.value; };
  window.addEventListener("hashchange", go);
  go();
}());
