/* actstore view, ViT stores: a feature's rows as a grid of images, its per-patch activations
   drawn over each image's thumbnail on a canvas (written once per image: img/<n // bucket>/<n>.jpg).
   A card is one image of a group; it names the image, then each of its rows: rank, the patch
   (row, column) that fired, outlined, and the activation. A patch's colour is its value on the
   feature's scale (as the text rows: orange positive, blue negative, 0 transparent); hover a
   patch for its value. */
(function () {
  var A = window.ACTSTORE, M = A.meta;
  var POS = "255,110,0", NEG = "30,110,255", ALPHA = 0.85;  // as the text rows: orange positive, blue negative
  var MAX_LINES = 4;  // rows listed under a card; the rest on hover
  function where(t) {
    var I = M.image, p = t - I.prefix;
    if (p < 0) { return I.cls && t === 0 ? "CLS" : "prefix token " + t; }
    return "(" + Math.floor(p / I.grid[1]) + ", " + (p % I.grid[1]) + ")";
  }
  function grids(R) {  // each image's patch values (Float32Array of grid_h x grid_w)
    if (R.grids) { return R.grids; }
    var P = M.image.grid[0] * M.image.grid[1], C = R.cols, v = A.unpack(C.pv), n = R.images.length, out = [], k;
    for (k = 0; k < n; k++) { out.push(new Float32Array(P)); }
    if (C.pi) {
      var idx = A.unpack(C.pi);
      for (k = 0; k < idx.length; k++) { out[Math.floor(idx[k] / P)][idx[k] % P] = v[k]; }
    } else {
      for (k = 0; k < n; k++) { out[k].set(v.subarray(k * P, (k + 1) * P)); }
    }
    R.grids = out;
    return out;
  }
  // the cards of one group's rows (in rank order): one per image, its rows listed
  function grid(R, rows) {
    var cards = [], byImage = {}, T = M.image.thumb;
    rows.forEach(function (r) {
      var k = R.rows.im[r];
      if (!(k in byImage)) { byImage[k] = cards.length; cards.push({k: k, rows: []}); }
      cards[byImage[k]].rows.push(r);
    });
    return '<div class="imgrid">' + cards.map(function (c) {
      var name = R.images[c.k][1], lines = c.rows.map(function (r) {
        return "#" + R.rows.rank[r] + " " + where(R.rows.tok[r]) + " " + A.g(R.rows.act[r]);
      });
      var shown = lines.slice(0, MAX_LINES).map(function (l) { return '<span class="prow">' + A.esc(l) + "</span>"; }).join("");
      if (lines.length > MAX_LINES) { shown += '<span class="prow meta" title="' + A.esc(lines.slice(MAX_LINES).join("\n")) + '">+' + (lines.length - MAX_LINES) + " more</span>"; }
      return '<figure class="icard"><canvas class="heat" width="' + T + '" height="' + T + '" data-k="' + c.k + '" data-rows="' + c.rows.join(",") +
        '"></canvas><figcaption><b class="iname" title="example ' + R.rows.ex[c.rows[0]] + '">' + A.esc(name) + "</b>" + shown + "</figcaption></figure>";
    }).join("") + "</div>";
  }
  var cache = {};
  function image(n, done) {  // a thumbnail, loaded once per page
    var e = cache[n];
    if (!e) {
      e = cache[n] = {img: new Image(), wait: [], state: 0};
      e.img.onload = function () { e.state = 1; e.wait.forEach(function (f) { f(e.img); }); };
      e.img.onerror = function () { e.state = 2; e.wait.forEach(function (f) { f(null); }); };
      e.img.src = "img/" + Math.floor(n / M.image.bucket) + "/" + n + ".jpg";
    }
    if (e.state) { done(e.state === 1 ? e.img : null); } else { e.wait.push(done); }
  }
  function paint(cv, img, values, rows, R, ref) {
    var I = M.image, gh = I.grid[0], gw = I.grid[1], T = cv.width, ph = T / gh, pw = T / gw, ctx = cv.getContext("2d"), p;
    if (img) { ctx.drawImage(img, 0, 0, T, T); } else { ctx.fillStyle = "#d0d5dd"; ctx.fillRect(0, 0, T, T); }
    for (p = 0; p < values.length; p++) {
      var v = values[p], top = ref[v >= 0 ? 0 : 1], t = top ? Math.min(1, Math.abs(v) / top) : 0;
      if (!(t > 0)) { continue; }
      ctx.fillStyle = "rgba(" + (v >= 0 ? POS : NEG) + "," + (ALPHA * t).toFixed(3) + ")";
      ctx.fillRect(Math.floor(p % gw) * pw, Math.floor(p / gw) * ph, pw, ph);
    }
    ctx.strokeStyle = "rgb(0,255,0)";
    ctx.lineWidth = 2;
    rows.forEach(function (r) {
      var q = R.rows.tok[r] - I.prefix;
      if (q >= 0) { ctx.strokeRect((q % gw) * pw + 1, Math.floor(q / gw) * ph + 1, pw - 2, ph - 2); }
    });
    cv.onmousemove = function (e) {
      var b = cv.getBoundingClientRect(), c = Math.floor((e.clientX - b.left) / b.width * gw), r = Math.floor((e.clientY - b.top) / b.height * gh);
      if (r >= 0 && r < gh && c >= 0 && c < gw) { cv.title = "patch (" + r + ", " + c + "): " + A.g(values[r * gw + c]); }
    };
    var b = cv.getBoundingClientRect();
    cv.dataset.box = [b.left + window.scrollX, b.top + window.scrollY, b.width, b.height].map(Math.round).join(",");
    cv.dataset.drawn = img ? "1" : "no image";
  }
  function draw(R, page, ref) {
    var G = grids(R), cvs = page.querySelectorAll("canvas.heat"), left = cvs.length;
    page.dataset.drawn = "0";
    cvs.forEach(function (cv) {
      var k = +cv.dataset.k, rows = cv.dataset.rows.split(",").map(Number);
      image(R.images[k][0], function (img) {
        if (!cv.isConnected) { return; }  // another feature was shown meanwhile
        paint(cv, img, G[k], rows, R, ref);
        left--;
        page.dataset.drawn = String(cvs.length - left);
      });
    });
  }
  A.vision = {grid: grid, draw: draw, where: where};
}());
