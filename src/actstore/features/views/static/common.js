/* actstore view: what both pages share. Data files are scripts that call ACTSTORE.load(kind,
   value) (pages opened from file:// may not fetch); text is escaped, control and bidi
   characters are shown as visible marks, never interpreted. */
(function () {
  var A = window.ACTSTORE = window.ACTSTORE || {};
  A.load = function (kind, value) { A[kind] = value; };
  A.script = function (src, kind, done, fail) {
    var s = document.createElement("script");
    A[kind] = undefined;
    s.src = src;
    s.onload = function () { s.remove(); if (A[kind] === undefined) { fail(); } else { done(A[kind]); } };
    s.onerror = function () { s.remove(); fail(); };
    document.head.appendChild(s);
  };
  var HTML = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
  A.esc = function (s) { return String(s).replace(/[&<>"']/g, function (c) { return HTML[c]; }); };
  // bidi controls, zero-width and other invisible characters: a visible, isolated mark
  var CTL = /[\u0000-\u0008\u000b\u000c\u000e-\u001f\u007f\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]/g;
  A.show = function (s) {
    return A.esc(s).replace(CTL, function (c) {
      var h = c.charCodeAt(0).toString(16).toUpperCase();
      return '<span class="ctl" title="U+' + ("000" + h).slice(-4) + '">U+' + ("000" + h).slice(-4) + "</span>";
    }).replace(/\n/g, '<span class="nl">\u21b5</span>\n').replace(/\r/g, '<span class="nl">\u240d</span>').replace(/\t/g, '<span class="nl">\u2192</span>\t');
  };
  // one line (the index): newlines and tabs become marks, nothing breaks the row
  A.line = function (s) { return A.show(String(s).replace(/[\r\n\t]/g, function (c) { return c === "\t" ? "\u2192" : "\u21b5"; })); };
  A.g = function (x, d) { if (x === null || x === undefined) { return ""; } return Number(x).toPrecision(d || 4).replace(/(\.\d*?)0+(e|$)/, "$1$2").replace(/\.(e|$)/, "$1"); };
  A.pct = function (x) {
    if (x === null || x === undefined) { return ""; }
    var p = 100 * x;
    if (p === 0) { return "0%"; }
    return (p >= 0.01 ? p.toFixed(p >= 10 ? 1 : p >= 1 ? 2 : 3) : p.toExponential(1)) + "%";
  };
  A.int = function (n) { return Number(n).toLocaleString("en-US"); };
  // [dtype, base64 of little-endian values] (sitedata.pack) -> a typed array
  var TYPES = {"<i2": Int16Array, "<i4": Int32Array, "<f4": Float32Array, "<f8": Float64Array};
  // float16 -> Float32Array (browsers without Float16Array included)
  function half(u16) {
    var out = new Float32Array(u16.length);
    for (var i = 0; i < u16.length; i++) {
      var h = u16[i], e = (h >> 10) & 31, m = h & 1023, s = h & 32768 ? -1 : 1;
      out[i] = e === 0 ? s * m * Math.pow(2, -24) : e === 31 ? (m ? NaN : s * Infinity) : s * (1024 + m) * Math.pow(2, e - 25);
    }
    return out;
  }
  A.unpack = function (col) {
    var s = atob(col[1]), u = new Uint8Array(s.length);
    for (var i = 0; i < s.length; i++) { u[i] = s.charCodeAt(i); }
    return col[0] === "<f2" ? half(new Uint16Array(u.buffer)) : new TYPES[col[0]](u.buffer);
  };
  A.featurePath = function (f, bucket) { return "data/f/" + Math.floor(f / bucket) + "/" + f + ".js"; };
  // a bar chart: heights on a log scale, labels on hover
  A.bars = function (counts, labels, colours, w, h) {
    var n = counts.length, top = 0, i, out = [];
    for (i = 0; i < n; i++) { top = Math.max(top, counts[i]); }
    var bw = w / Math.max(n, 1);
    out.push('<svg xmlns="http://www.w3.org/2000/svg" width="' + w + '" height="' + (h + 16) + '" role="img">');
    for (i = 0; i < n; i++) {
      var v = counts[i], bh = v ? Math.max(1, Math.log1p(v) / Math.log1p(top) * (h - 4)) : 0;
      out.push('<rect x="' + (i * bw).toFixed(1) + '" y="' + (h - bh).toFixed(1) + '" width="' + Math.max(bw - 1, 1).toFixed(1) +
        '" height="' + bh.toFixed(1) + '" fill="' + (typeof colours === "string" ? colours : colours[i]) + '"><title>' + A.esc(labels[i]) + ": " + A.int(v) + "</title></rect>");
    }
    out.push('<line x1="0" y1="' + h + '" x2="' + w + '" y2="' + h + '" stroke="#d0d5dd"/>');
    return out;
  };
}());
