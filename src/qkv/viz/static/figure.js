/* qkv attention explorer: a drawing that can be shown as SVG and painted onto a canvas (figure.js).
 * Views build a Q.Figure of rects, lines, texts, raster images and translated groups; toSVG() makes
 * the on-screen (or exported) SVG with every presentation attribute written out (no page CSS is
 * needed to read it), and toCanvas() paints the same items for a PNG. */
(function (Q) {
  "use strict";

  var FONT = "system-ui, -apple-system, 'Segoe UI', sans-serif";
  /* item properties that are not SVG attributes */
  var NOT_ATTRIBUTES = { text: 1, canvas: 1, dx: 1, dy: 1, title: 1, batched: 1 };
  var OPACITY_LEVELS = 64; // a batched group's lines: opacities rounded to this many levels (as lines.js does)
  var ANCHOR_TO_ALIGN = { start: "left", middle: "center", end: "right" };

  Q.FONT = FONT;

  function Group(props) {
    this.props = props || {};
    this.items = [];
  }

  Group.prototype.add = function (kind, props) {
    var item = { kind: kind, props: props };
    this.items.push(item);
    return item;
  };
  Group.prototype.rect = function (props) { return this.add("rect", props); };
  Group.prototype.line = function (props) { return this.add("line", props); };
  /* props.text is set as textContent */
  Group.prototype.text = function (props) { return this.add("text", props); };
  /* props.canvas: a raster (an HTML canvas) drawn at x, y, width, height without smoothing */
  Group.prototype.image = function (props) { return this.add("image", props); };
  /* a group moved by props.dx, props.dy; with props.batched (a group of many lines: a long input's
   * head view has tens of thousands), toCanvas strokes its lines as one path per colour, width and
   * opacity level, as the on-screen canvas does, instead of one stroke each (21 s for 45,000 lines) */
  Group.prototype.group = function (props) {
    var group = new Group(props);
    this.items.push({ kind: "g", props: group.props, group: group });
    return group;
  };

  /* A drawing of `width` x `height` CSS pixels. */
  function Figure(width, height) {
    Group.call(this, {});
    this.width = Math.ceil(width);
    this.height = Math.ceil(height);
  }
  Figure.prototype = Object.create(Group.prototype);

  /* Fill `svg` (or a new <svg>) with the drawing; with background, a white rect first (exports). */
  Figure.prototype.toSVG = function (svg, background) {
    svg = svg || document.createElementNS(Q.SVGNS, "svg");
    svg.textContent = "";
    svg.setAttribute("width", String(this.width));
    svg.setAttribute("height", String(this.height));
    svg.setAttribute("viewBox", "0 0 " + this.width + " " + this.height);
    svg.setAttribute("font-family", FONT);
    if (background) {
      svgItems(svg, [{ kind: "rect", props: { x: 0, y: 0, width: this.width, height: this.height, fill: "#ffffff" } }]);
    }
    svgItems(svg, this.items);
    return svg;
  };

  /* The drawing as a standalone SVG file's text. */
  Figure.prototype.toSVGText = function () {
    var svg = this.toSVG(null, true);
    svg.setAttribute("xmlns", Q.SVGNS);
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + new XMLSerializer().serializeToString(svg) + "\n";
  };

  function svgItems(parent, items) {
    items.forEach(function (item) {
      var p = item.props;
      var node = document.createElementNS(Q.SVGNS, item.kind);
      for (var name in p) {
        if (NOT_ATTRIBUTES[name] || p[name] === undefined || p[name] === null) { continue; }
        node.setAttribute(name, String(p[name]));
      }
      if (item.kind === "g" && (p.dx || p.dy)) {
        node.setAttribute("transform", "translate(" + (p.dx || 0) + "," + (p.dy || 0) + ")");
      }
      if (item.kind === "text") { node.textContent = p.text; }
      if (item.kind === "image") {
        node.setAttribute("href", p.canvas.toDataURL("image/png"));
        node.setAttribute("preserveAspectRatio", "none");
        node.setAttribute("style", "image-rendering: pixelated");
      }
      if (p.title) {
        var title = document.createElementNS(Q.SVGNS, "title");
        title.textContent = p.title;
        node.appendChild(title);
      }
      if (item.kind === "g") { svgItems(node, item.group.items); }
      parent.appendChild(node);
    });
  }

  /* The drawing painted on a new canvas, `scale` device pixels per CSS pixel, on white. */
  Figure.prototype.toCanvas = function (scale) {
    var canvas = document.createElement("canvas");
    canvas.width = Math.ceil(this.width * scale);
    canvas.height = Math.ceil(this.height * scale);
    var ctx = canvas.getContext("2d");
    ctx.scale(scale, scale);
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(0, 0, this.width, this.height);
    paint(ctx, this.items);
    return canvas;
  };

  function number(value, fallback) {
    return value === undefined || value === null ? fallback : Number(value);
  }

  function paint(ctx, items) {
    items.forEach(function (item) {
      var p = item.props;
      ctx.save();
      if (item.kind === "rect") {
        var rx = number(p.rx, 0);
        ctx.beginPath();
        if (rx > 0 && ctx.roundRect) {
          ctx.roundRect(number(p.x, 0), number(p.y, 0), Number(p.width), Number(p.height), rx);
        } else {
          ctx.rect(number(p.x, 0), number(p.y, 0), Number(p.width), Number(p.height));
        }
        if (p.fill && p.fill !== "none") {
          ctx.globalAlpha = number(p["fill-opacity"], 1);
          ctx.fillStyle = p.fill;
          ctx.fill();
        }
        if (p.stroke && p.stroke !== "none") {
          ctx.globalAlpha = number(p["stroke-opacity"], 1);
          ctx.strokeStyle = p.stroke;
          ctx.lineWidth = number(p["stroke-width"], 1);
          ctx.stroke();
        }
      } else if (item.kind === "line") {
        ctx.globalAlpha = number(p["stroke-opacity"], 1);
        ctx.strokeStyle = p.stroke || "#000000";
        ctx.lineWidth = number(p["stroke-width"], 1);
        ctx.lineCap = p["stroke-linecap"] || "butt";
        ctx.beginPath();
        ctx.moveTo(Number(p.x1), Number(p.y1));
        ctx.lineTo(Number(p.x2), Number(p.y2));
        ctx.stroke();
      } else if (item.kind === "text") {
        ctx.globalAlpha = number(p["fill-opacity"], 1);
        ctx.fillStyle = p.fill || "#1d232a";
        ctx.font = (p["font-weight"] || "normal") + " " + number(p["font-size"], 13) + "px " + FONT;
        ctx.textAlign = ANCHOR_TO_ALIGN[p["text-anchor"] || "start"];
        ctx.textBaseline = p["dominant-baseline"] === "middle" ? "middle" : "alphabetic";
        ctx.fillText(p.text, number(p.x, 0), number(p.y, 0));
      } else if (item.kind === "image") {
        ctx.imageSmoothingEnabled = false;
        ctx.drawImage(p.canvas, Number(p.x), Number(p.y), Number(p.width), Number(p.height));
      } else if (item.kind === "g") {
        ctx.translate(p.dx || 0, p.dy || 0);
        if (p.batched) { paintBatched(ctx, item.group.items); } else { paint(ctx, item.group.items); }
      }
      ctx.restore();
    });
  }

  /* Lines grouped into one path per stroke colour, width, cap and opacity level; other items one by one. */
  function paintBatched(ctx, items) {
    var paths = {}, others = [];
    items.forEach(function (item) {
      var p = item.props;
      if (item.kind !== "line") { others.push(item); return; }
      var opacity = Math.max(0, Math.min(1, number(p["stroke-opacity"], 1)));
      var level = Math.min(OPACITY_LEVELS - 1, Math.floor(opacity * OPACITY_LEVELS));
      var key = [p.stroke || "#000000", number(p["stroke-width"], 1), p["stroke-linecap"] || "butt", level].join("|");
      var path = paths[key] || (paths[key] = new Path2D());
      path.moveTo(Number(p.x1), Number(p.y1));
      path.lineTo(Number(p.x2), Number(p.y2));
    });
    Object.keys(paths).forEach(function (key) {
      var parts = key.split("|");
      ctx.save();
      ctx.strokeStyle = parts[0];
      ctx.lineWidth = Number(parts[1]);
      ctx.lineCap = parts[2];
      ctx.globalAlpha = (Number(parts[3]) + 0.5) / OPACITY_LEVELS;
      ctx.stroke(paths[key]);
      ctx.restore();
    });
    paint(ctx, others);
  }

  var measurer = null;

  /* The width in CSS pixels of `text` in the figures' font. */
  Q.textWidth = function (text, size, weight) {
    if (!measurer) { measurer = document.createElement("canvas").getContext("2d"); }
    measurer.font = (weight || "normal") + " " + size + "px " + FONT;
    return measurer.measureText(text).width;
  };

  Q.Figure = Figure;
})(window.qkvExplorer);
