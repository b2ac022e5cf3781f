#include "plot.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "sparse_attn/errors.h"

#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_STATIC
#include <stb_easy_font.h>
#include <stb_image_write.h>

namespace sparse_attn::cli {
namespace {

struct Rgb {
  unsigned char r, g, b;
};

class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), px_(static_cast<size_t>(w) * h * 3, 255) {}
  void fill(int x0, int y0, int x1, int y1, Rgb c) {
    x0 = std::max(x0, 0), y0 = std::max(y0, 0), x1 = std::min(x1, w_), y1 = std::min(y1, h_);
    for (int y = y0; y < y1; ++y)
      for (int x = x0; x < x1; ++x) {
        unsigned char* p = &px_[(static_cast<size_t>(y) * w_ + x) * 3];
        p[0] = c.r, p[1] = c.g, p[2] = c.b;
      }
  }
  void ring(int cx, int cy, int radius, int thickness, Rgb c) {
    for (int y = cy - radius; y <= cy + radius; ++y)
      for (int x = cx - radius; x <= cx + radius; ++x) {
        const double d = std::hypot(x - cx, y - cy);
        if (d <= radius && d > radius - thickness) fill(x, y, x + 1, y + 1, c);
      }
  }
  // Text from stb_easy_font's quads (about 7 px tall), scaled by `scale`.
  void text(int x, int y, const std::string& s, int scale, Rgb c) {
    std::vector<char> buf(s.size() * 300 + 64);
    std::string copy = s;
    const int quads =
        stb_easy_font_print(0, 0, copy.data(), nullptr, buf.data(), static_cast<int>(buf.size()));
    const float* v = reinterpret_cast<const float*>(buf.data());
    for (int q = 0; q < quads; ++q) {
      // 4 vertices of 16 bytes (x, y, z, rgba); axis-aligned rectangles.
      const float* a = v + q * 16;
      const float* b = a + 8;
      fill(x + int(a[0] * scale), y + int(a[1] * scale), x + int(b[0] * scale),
           y + int(b[1] * scale), c);
    }
  }
  static int text_width(const std::string& s, int scale) {
    std::string copy = s;
    return stb_easy_font_width(copy.data()) * scale;
  }
  const unsigned char* data() const { return px_.data(); }
  int width() const { return w_; }
  int height() const { return h_; }

 private:
  int w_, h_;
  std::vector<unsigned char> px_;
};

Rgb shade(float v) {
  if (v < 0) return {255, 255, 255};
  const Rgb lo{228, 228, 232}, hi{16, 52, 150};
  v = std::clamp(v, 0.f, 1.f);
  auto mix = [v](unsigned char a, unsigned char b) {
    return static_cast<unsigned char>(std::lround(a + (b - a) * v));
  };
  return {mix(lo.r, hi.r), mix(lo.g, hi.g), mix(lo.b, hi.b)};
}

}  // namespace

void write_heatmap_png(const std::string& path, const Heatmap& map) {
  if (map.rows <= 0 || map.cols <= 0 ||
      map.value.size() != static_cast<size_t>(map.rows * map.cols))
    throw ValueError(fmt::format("{}: nothing to plot ({} x {} cells)", path, map.rows, map.cols));
  // Cells are whole pixels: the map is scaled up to at least ~800 x 500 and down never.
  const int cw = std::max<int>(1, static_cast<int>(800 / map.cols));
  const int ch = std::max<int>(1, static_cast<int>(500 / map.rows));
  const int mw = static_cast<int>(map.cols) * cw, mh = static_cast<int>(map.rows) * ch;
  constexpr int kText = 2, kLine = 24, kLeft = 130, kBottom = 60, kRight = 70;
  const int top = 16 + kLine * static_cast<int>(map.header.size()) + 16;
  int width = kLeft + mw + kRight;
  for (const auto& line : map.header)
    width = std::max(width, kLeft + Canvas::text_width(line, kText) + 20);
  Canvas c(width, top + mh + kBottom);
  const int kTop = top;
  const Rgb ink{30, 30, 30}, grid{120, 120, 120}, tick{120, 40, 160};

  for (int64_t r = 0; r < map.rows; ++r)
    for (int64_t k = 0; k < map.cols; ++k)
      c.fill(kLeft + int(k) * cw, kTop + int(r) * ch, kLeft + int(k + 1) * cw,
             kTop + int(r + 1) * ch, shade(map.value[r * map.cols + k]));
  // Frame.
  c.fill(kLeft - 1, kTop - 1, kLeft + mw + 1, kTop, grid);
  c.fill(kLeft - 1, kTop + mh, kLeft + mw + 1, kTop + mh + 1, grid);
  c.fill(kLeft - 1, kTop - 1, kLeft, kTop + mh + 1, grid);
  c.fill(kLeft + mw, kTop - 1, kLeft + mw + 1, kTop + mh + 1, grid);

  for (const auto& m : map.marks) {
    const int cx = kLeft + int(m.col) * cw + cw / 2, cy = kTop + int(m.row) * ch + ch / 2;
    const int radius = std::max(6, std::min(cw, ch) / 2 + 4);
    c.ring(cx, cy, radius, 2, m.kept ? Rgb{20, 170, 60} : Rgb{220, 30, 30});
    c.fill(cx - 1, kTop - 9, cx + 2, kTop - 2, tick);
  }

  for (size_t i = 0; i < map.header.size(); ++i)
    c.text(kLeft, 16 + kLine * static_cast<int>(i), map.header[i], kText, ink);
  c.text(kLeft, kTop + mh + 8, map.x_first, kText, ink);
  c.text(kLeft + mw - Canvas::text_width(map.x_last, kText), kTop + mh + 8, map.x_last, kText, ink);
  c.text(kLeft + (mw - Canvas::text_width(map.x_label, kText)) / 2, kTop + mh + 32, map.x_label,
         kText, ink);
  c.text(kLeft - 8 - Canvas::text_width(map.y_first, kText), kTop, map.y_first, kText, ink);
  c.text(kLeft - 8 - Canvas::text_width(map.y_last, kText), kTop + mh - 16, map.y_last, kText, ink);
  c.text(6, kTop + mh / 2, map.y_label, kText, ink);

  if (!stbi_write_png(path.c_str(), c.width(), c.height(), 3, c.data(), c.width() * 3))
    throw ValueError(
        fmt::format("--plot {}: cannot write the PNG (check the directory and "
                    "permissions)",
                    path));
}

std::string plot_path_for(const std::string& path, const std::string& method) {
  const auto dot = path.rfind('.');
  const auto slash = path.rfind('/');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash))
    return path + "-" + method;
  return path.substr(0, dot) + "-" + method + path.substr(dot);
}

}  // namespace sparse_attn::cli
