/* qkv attention explorer: Save PNG and Save SVG (export.js). Each panel's figure (a Q.Figure of
 * what it shows now) is written to an SVG file's text or painted on a canvas, and handed to the
 * browser as a download from a blob: URL; nothing leaves the machine. */
(function (Q) {
  "use strict";

  var MAX_SIDE = 16000; // device pixels: PNGs of very long inputs are drawn at a smaller scale
  /* CSS pixels: larger drawings (a long input's head view) are saved at scale 1: Chromium takes 42 s
   * to encode a 512-token head view (352 x 7730) as PNG at scale 2, 1-3 s at scale 1 */
  var DOUBLE_UP_TO = 1.5e6;

  /* `fig` under a one-line title. */
  Q.titled = function (fig, title) {
    var out = new Q.Figure(Math.max(fig.width, Q.textWidth(title, 13, "bold") + 16), fig.height + 34);
    out.text({ x: 8, y: 16, text: title, "font-size": 13, "font-weight": "bold", fill: "#1d232a",
               "dominant-baseline": "middle" });
    out.group({ dx: 0, dy: 34 }).items = fig.items;
    return out;
  };

  /* The figure named `name` of the current panel. */
  function figureNamed(name) {
    for (var i = 0; i < Q.tabs.length; i++) {
      var figures = Q.tabs[i].figures || {};
      if (figures[name]) { return figures[name](); }
    }
    throw new Error("no figure named " + name);
  }

  function download(filename, blob) {
    var url = URL.createObjectURL(blob);
    var link = Q.html("a", { href: url, download: filename }, document.body);
    link.hidden = true;
    link.click();
    document.body.removeChild(link);
    setTimeout(function () { URL.revokeObjectURL(url); }, 60000);
  }

  /* Save figure `name` as "png" or "svg"; the file is qkv-<name>.<format>. */
  Q.save = function (name, format) {
    var fig = figureNamed(name);
    var filename = "qkv-" + name + "." + format;
    if (format === "svg") {
      download(filename, new Blob([fig.toSVGText()], { type: "image/svg+xml" }));
      return;
    }
    var scale = Math.max(0.25, Math.min(fig.width * fig.height > DOUBLE_UP_TO ? 1 : 2,
                                        MAX_SIDE / Math.max(fig.width, fig.height)));
    download(filename, pngBlob(fig.toCanvas(scale)));
  };

  /* The canvas as a PNG blob, at once: canvas.toBlob waits for the browser to be idle, which after
   * a click can take a second. */
  function pngBlob(canvas) {
    var base64 = canvas.toDataURL("image/png").split(",")[1];
    var text = atob(base64);
    var bytes = new Uint8Array(text.length);
    for (var i = 0; i < text.length; i++) { bytes[i] = text.charCodeAt(i); }
    return new Blob([bytes], { type: "image/png" });
  }

  Q.wireSaveButtons = function () {
    Array.prototype.forEach.call(document.querySelectorAll(".save button"), function (button) {
      button.addEventListener("click", function () {
        try {
          Q.save(button.parentNode.dataset.figure, button.dataset.format);
        } catch (err) {
          Q.showError("cannot save this view: " + err.message);
        }
      });
    });
  };
})(window.qkvExplorer);
