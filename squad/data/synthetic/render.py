"""A small analytic CPU ray caster for the synthetic Taskonomy (see ``squad.data.synthetic``).

Scenes are one axis-aligned room (floor, ceiling, four walls, with openings — windows, doorways, holes in the scan —
through which rays leave the scene) holding boxes (rotated about the vertical axis), spheres and upright capped
cylinders, lit by one point light. Every ray-primitive intersection is closed-form and vectorised over all pixels
with numpy, so one 64 x 64 view of a furnished room costs about 10 ms.

Taskonomy's meshes are smoothed scans: no crease is sharp, and the curvature the generator computes on them
(MeshLab's APSS fit over a few vertex spacings) is rarely exactly zero. These stand in for that here:

* **Rounded creases.** Room edges (concave, seen from inside) and the edges of boxes and cylinder rims (convex) are
  rounded with a radius ``bevel``: within ``bevel`` metres of an edge the normal turns toward the neighbouring face
  (up to 45 degrees at the edge itself) and the curvature across the edge is ``-1/bevel`` (concave) or
  ``+1/bevel`` (convex). The hit point itself stays on the unrounded face (an error below ``0.3 * bevel`` in depth).
* **Scan roughness and clutter.** ``Scene.roughness`` adds a smooth random field (3-D value noise in world
  coordinates, 12 cm cells, fixed per scene) of that standard deviation, in 1/m, to both principal curvatures, and
  ``Scene.clutter`` sparse spikes (the parts of two more such fields beyond 1.5 standard deviations, times
  ``clutter``) that stand for detail the scene does not model (folds, books, cables, plants). Neither moves normals
  or depth: millimetre bumps at centimetre scale bend the surface strongly and tilt it little.
* Along a rounded crease the curvature is ``ALONG_CREASE`` times the one across it (APSS's sphere fit bends both
  ways; the ratio of the 95th-percentile deviations of the two channels on a real Taskonomy view is about 0.2-0.3).

Conventions (all lengths in metres):
    * World frame: x and z span the floor, y points up; the room occupies ``[0, W] x [0, H] x [0, D]``.
    * Camera frame: x to the image's right, y to the image's bottom, z forward into the scene (the frame of
      Taskonomy's normal files), pinhole with square pixels, no roll. Pixel (i, j) looks through its centre.
    * ``distance`` is the Euclidean distance from the camera centre to the hit point; ``zdepth`` its projection
      on the optical axis (so ``zdepth <= distance``). Both are ``inf`` where the ray hits nothing.
    * Principal curvatures are signed, positive where the surface bends away from its normal (convex, e.g. a
      sphere seen from outside has ``k1 = k2 = 1 / radius``); ``k1`` is the one of larger magnitude
      (``|k1| >= |k2|``), as MeshLab's APSS K1 / K2 that Taskonomy's generator stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_EPS = 1e-6
ROOM_FACES = ("floor", "ceiling", "wall_x0", "wall_x1", "wall_z0", "wall_z1")
NUM_ROOM_FACES = len(ROOM_FACES)
ALONG_CREASE = 0.3  # APSS's sphere fit bends along a rounded crease too, by about this share of the bend across
LAMP_HALF_LIFE = 8.0  # metres: Taskonomy's reshading lamp (Blender inverse-square falloff D / (D + r^2))


def value_noise(p: np.ndarray, cell: float, seed: int, channels: int = 1) -> np.ndarray:
    """Smooth pseudo-random fields in about [-1, 1] (standard deviation about ``NOISE_STD``) at points ``p`` (N, D):
    values hashed on a lattice of spacing ``cell`` and interpolated with smoothstep weights. Returns (N, channels)
    independent fields; the same (p, cell, seed) give the same values."""
    q = p / cell
    i0 = np.floor(q)
    f = q - i0
    w = f * f * (3.0 - 2.0 * f)  # (N, D) smoothstep
    i0 = i0.astype(np.int64)
    primes = (73856093, 19349663, 83492791)
    corners = [(i0[:, a] * primes[a], (i0[:, a] + 1) * primes[a], 1.0 - w[:, a], w[:, a]) for a in range(p.shape[1])]
    salts = [np.uint64((seed * 0x9E3779B1 + c * 0x85EBCA77) % (1 << 63)) for c in range(channels)]
    out = np.zeros((len(p), channels))

    def walk(axis: int, h: np.ndarray, weight: np.ndarray | float) -> None:
        if axis == len(corners):
            hu = h.astype(np.uint64)
            for c, salt in enumerate(salts):
                x = (hu ^ salt) * np.uint64(0x9E3779B97F4A7C15)
                x ^= x >> np.uint64(29)
                out[:, c] += weight * ((x >> np.uint64(48)).astype(np.float64) / 32767.5 - 1.0)
            return
        h0, h1, w0, w1 = corners[axis]
        walk(axis + 1, h + h0, weight * w0)
        walk(axis + 1, h + h1, weight * w1)

    walk(0, np.zeros(len(p), np.int64), 1.0)
    return out


NOISE_STD = 0.37  # standard deviation of value_noise over space


@dataclass(frozen=True)
class Material:
    """Surface colour: a base albedo, a second albedo and a procedural pattern mixing them, plus a fine grain.

    Args:
        color: linear RGB albedo in [0, 1].
        color2: second albedo used by the pattern.
        pattern: "plain", "stripes" (bands across u), "bands" (bands across v) or "checker".
        scale: pattern period in metres of surface coordinate.
        grain: contrast of a fine multiplicative value-noise texture (wood grain, fabric, plaster), 0 = none.
    """

    color: tuple[float, float, float]
    color2: tuple[float, float, float] = (0.0, 0.0, 0.0)
    pattern: str = "plain"
    scale: float = 0.25
    grain: float = 0.0

    def __post_init__(self) -> None:
        if self.pattern not in ("plain", "stripes", "bands", "checker"):
            raise ValueError(f"Material.pattern must be plain|stripes|bands|checker, got {self.pattern!r}")
        if self.scale <= 0:
            raise ValueError(f"Material.scale must be > 0, got {self.scale}")
        if not 0 <= self.grain < 1:
            raise ValueError(f"Material.grain must be in [0, 1), got {self.grain}")

    def albedo(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Albedo at surface coordinates (u, v) in metres, before grain: (N,) each -> (N, 3)."""
        c1, c2 = np.asarray(self.color, np.float64), np.asarray(self.color2, np.float64)
        if self.pattern == "plain":
            return np.broadcast_to(c1, (u.shape[0], 3)).copy()
        if self.pattern == "stripes":
            second = np.mod(u / self.scale, 1.0) < 0.5
        elif self.pattern == "bands":
            second = np.mod(v / self.scale, 1.0) < 0.3
        else:
            second = (np.floor(u / self.scale) + np.floor(v / self.scale)) % 2 == 1
        return np.where(second[:, None], c2, c1)


def _round_edges(n: np.ndarray, k: np.ndarray, s: np.ndarray, toward: np.ndarray, bevel: float, sign: float) -> None:
    """Bend normals ``n`` (N, 3, in place) toward ``toward`` (N, 3) where the distance ``s`` (N,) to an edge is below
    ``bevel``, and record curvature ``sign / bevel`` across that edge in ``k`` (N, 2): column 0, with
    ``ALONG_CREASE`` times it in column 1 (column 1 alone where column 0 already holds another edge: a corner)."""
    band = s < bevel
    if not band.any():
        return
    phi = np.pi / 4 * (1.0 - s[band] / bevel)  # 0 where the rounding starts, 45 degrees at the edge
    n[band] += np.tan(phi)[:, None] * toward[band]
    kb = k[band]
    first = np.abs(kb[:, 0]) < 0.99 / bevel  # not yet across another edge: this edge is the main bend
    kb[first, 0] = sign / bevel
    kb[first, 1] = np.where(kb[first, 1] == 0, sign * ALONG_CREASE / bevel, kb[first, 1])
    kb[~first, 1] = sign / bevel  # a corner: bent both ways
    k[band] = kb


@dataclass(frozen=True)
class Box:
    """A box resting in the scene, rotated by ``yaw`` radians about the vertical axis through its centre, its edges
    rounded with radius ``bevel`` metres."""

    center: tuple[float, float, float]
    half: tuple[float, float, float]
    yaw: float
    material: Material
    category: int = -1
    bevel: float = 0.0

    def _rot(self) -> np.ndarray:
        c, s = np.cos(self.yaw), np.sin(self.yaw)
        return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])  # world = R @ local

    def bounding_radius(self) -> float:
        return float(np.linalg.norm(self.half))

    def intersect(self, o: np.ndarray, d: np.ndarray) -> np.ndarray:
        """Ray parameter of the first hit in front of the origin, inf if none. o, d: (N, 3) -> (N,)."""
        rot, h = self._rot(), np.asarray(self.half)
        ol, dl = (o - np.asarray(self.center)) @ rot, d @ rot  # (N, 3) in the box frame
        dl = np.where(np.abs(dl) < 1e-12, 1e-12, dl)
        t1, t2 = (-h - ol) / dl, (h - ol) / dl
        tn, tf = np.minimum(t1, t2).max(axis=1), np.maximum(t1, t2).min(axis=1)
        return np.where((tn <= tf) & (tn > _EPS), tn, np.inf)

    def surface(self, p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Normal (N, 3), curvatures (N, 2), texture coordinates u, v (N,) at surface points p (N, 3)."""
        rot, h = self._rot(), np.asarray(self.half)
        pl = (p - np.asarray(self.center)) @ rot
        axis = np.argmax(np.abs(pl) / h, axis=1)
        rows = np.arange(len(p))
        nl = np.zeros_like(pl)
        nl[rows, axis] = np.sign(pl[rows, axis])
        k = np.zeros((len(p), 2))
        if self.bevel > 0:
            for b in range(3):
                toward = np.zeros_like(pl)
                toward[:, b] = np.sign(pl[:, b])
                s = np.where(axis == b, np.inf, h[b] - np.abs(pl[:, b]))
                _round_edges(nl, k, s, toward, self.bevel, +1.0)
            nl /= np.linalg.norm(nl, axis=1, keepdims=True)
        # texture axes: the two local coordinates other than the face axis (vertical stays v where possible)
        u = np.where(axis == 0, pl[:, 2], pl[:, 0])
        v = np.where(axis == 1, pl[:, 2], pl[:, 1])
        return nl @ rot.T, k, u, v


@dataclass(frozen=True)
class Sphere:
    """A sphere of ``radius`` metres around ``center``."""

    center: tuple[float, float, float]
    radius: float
    material: Material
    category: int = -1

    def bounding_radius(self) -> float:
        return self.radius

    def intersect(self, o: np.ndarray, d: np.ndarray) -> np.ndarray:
        oc = o - np.asarray(self.center)
        b = np.einsum("ij,ij->i", oc, d)
        c = np.einsum("ij,ij->i", oc, oc) - self.radius**2
        disc = b * b - c
        t = -b - np.sqrt(np.maximum(disc, 0.0))
        return np.where((disc >= 0) & (t > _EPS), t, np.inf)

    def surface(self, p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        n = (p - np.asarray(self.center)) / self.radius
        n /= np.linalg.norm(n, axis=1, keepdims=True)
        u = np.arctan2(n[:, 2], n[:, 0]) * self.radius
        v = np.arcsin(np.clip(n[:, 1], -1, 1)) * self.radius
        return n, np.full((len(p), 2), 1.0 / self.radius), u, v


@dataclass(frozen=True)
class Cylinder:
    """An upright capped cylinder: axis along y from ``base`` (bottom-cap centre) up by ``height``; its rims rounded
    with radius ``bevel`` metres."""

    base: tuple[float, float, float]
    radius: float
    height: float
    material: Material
    category: int = -1
    bevel: float = 0.0

    def bounding_radius(self) -> float:
        return float(np.hypot(self.radius, self.height / 2))

    @property
    def center(self) -> tuple[float, float, float]:
        return (self.base[0], self.base[1] + self.height / 2, self.base[2])

    def intersect(self, o: np.ndarray, d: np.ndarray) -> np.ndarray:
        bx, y0, bz = self.base
        y1 = y0 + self.height
        ox, oy, oz = o[:, 0] - bx, o[:, 1], o[:, 2] - bz
        dx, dy, dz = d[:, 0], d[:, 1], d[:, 2]
        a = np.maximum(dx * dx + dz * dz, 1e-12)
        b = ox * dx + oz * dz
        disc = b * b - a * (ox * ox + oz * oz - self.radius**2)
        ts = (-b - np.sqrt(np.maximum(disc, 0.0))) / a
        ys = oy + ts * dy
        side = np.where((disc >= 0) & (ts > _EPS) & (ys >= y0) & (ys <= y1), ts, np.inf)
        best = side
        dy_safe = np.where(np.abs(dy) < 1e-12, 1e-12, dy)
        for yc in (y0, y1):
            tc = (yc - oy) / dy_safe
            rx, rz = ox + tc * dx, oz + tc * dz
            cap = np.where((tc > _EPS) & (rx * rx + rz * rz <= self.radius**2), tc, np.inf)
            best = np.minimum(best, cap)
        return best

    def surface(self, p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        bx, y0, bz = self.base
        rx, ry, rz = p[:, 0] - bx, p[:, 1] - y0, p[:, 2] - bz
        rho = np.hypot(rx, rz)
        dist = np.stack([np.abs(rho - self.radius), np.abs(ry), np.abs(ry - self.height)], axis=1)
        face = np.argmin(dist, axis=1)  # 0 side, 1 bottom cap, 2 top cap
        side = face == 0
        radial = np.stack([rx, np.zeros_like(rx), rz], 1) / np.maximum(rho, 1e-12)[:, None]
        up = np.zeros_like(p)
        up[:, 1] = 1.0
        n = np.where(side[:, None], radial, np.where((face == 2)[:, None], up, -up))
        k = np.zeros((len(p), 2))
        if self.bevel > 0:
            _round_edges(n, k, np.where(side, self.height - ry, np.inf), up, self.bevel, +1.0)
            _round_edges(n, k, np.where(side, ry, np.inf), -up, self.bevel, +1.0)
            _round_edges(n, k, np.where(side, np.inf, self.radius - rho), radial, self.bevel, +1.0)
        k[side, 1] = np.where(k[side, 0] == 0, 0.0, 1.0 / self.radius)  # along the rim: the side's own bend
        k[side & (k[:, 0] == 0), 0] = 1.0 / self.radius
        n /= np.maximum(np.linalg.norm(n, axis=1, keepdims=True), 1e-12)
        u = np.where(side, np.arctan2(rz, rx) * self.radius, rx)
        v = np.where(side, ry, rz)
        return n, k, u, v


Shape = Box | Sphere | Cylinder


@dataclass(frozen=True)
class Opening:
    """A hole in one room face — a window, a doorway, a gap in the scan: rays through it leave the scene.

    Args:
        face: index into ROOM_FACES.
        lo, hi: corners of the opening's bounding rectangle in the face's (u, v) coordinates, metres
            (floor/ceiling: (x, z); x-walls: (z, y); z-walls: (x, y)).
        ellipse: the opening is the ellipse inscribed in that rectangle rather than the rectangle.
        ragged: 0 for a clean outline; otherwise the seed of a noise field (20 cm cells) that leaves islands of
            surface inside the opening and frays its outline, as holes in a scanned mesh look.
    """

    face: int
    lo: tuple[float, float]
    hi: tuple[float, float]
    ellipse: bool = False
    ragged: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.face < NUM_ROOM_FACES:
            raise ValueError(f"Opening.face must be in 0..{NUM_ROOM_FACES - 1}, got {self.face}")
        if not (self.lo[0] < self.hi[0] and self.lo[1] < self.hi[1]):
            raise ValueError(f"Opening needs lo < hi on both axes, got lo={self.lo} hi={self.hi}")

    def contains(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """True where face coordinates (u, v) (N,) fall inside the opening."""
        if self.ellipse:
            cu, cv = (self.lo[0] + self.hi[0]) / 2, (self.lo[1] + self.hi[1]) / 2
            au, av = (self.hi[0] - self.lo[0]) / 2, (self.hi[1] - self.lo[1]) / 2
            inside = ((u - cu) / au) ** 2 + ((v - cv) / av) ** 2 < 1.0
        else:
            inside = (u > self.lo[0]) & (u < self.hi[0]) & (v > self.lo[1]) & (v < self.hi[1])
        if self.ragged and inside.any():
            inside[inside] = value_noise(np.stack([u[inside], v[inside]], 1), 0.2, self.ragged)[:, 0] > -0.1
        return inside


_FACE_NORMALS = np.array([[0, 1, 0], [0, -1, 0], [1, 0, 0], [-1, 0, 0], [0, 0, 1], [0, 0, -1]], np.float64)
_FACE_AXIS = (1, 1, 0, 0, 2, 2)  # the world axis each room face is normal to


@dataclass(frozen=True)
class Room:
    """The box ``[0, W] x [0, H] x [0, D]`` seen from inside, with per-surface materials, openings, and its edges
    (concave from inside) rounded with radius ``bevel`` metres."""

    size: tuple[float, float, float]
    floor: Material
    walls: Material
    ceiling: Material
    openings: tuple[Opening, ...] = ()
    bevel: float = 0.0

    def intersect(self, o: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Exit distance (N,) and face index (N,) of rays starting inside the room; inf through an opening."""
        hi = np.asarray(self.size)
        dd = np.where(np.abs(d) < 1e-12, 1e-12, d)
        t_axes = np.where(dd > 0, (hi - o) / dd, -o / dd)  # (N, 3) distance to the wall ahead on each axis
        axis = np.argmin(t_axes, axis=1)
        t = t_axes[np.arange(len(o)), axis]
        positive = dd[np.arange(len(o)), axis] > 0
        # faces: y -> floor/ceiling, x -> wall_x0/x1, z -> wall_z0/z1
        face = np.select([axis == 1, axis == 0], [0 + positive, 2 + positive], 4 + positive)
        if self.openings:
            u, v = _wall_uv(o + t[:, None] * d, face)
            through = np.zeros(len(o), bool)
            for w in self.openings:
                through |= (face == w.face) & w.contains(u, v)
            t = np.where(through, np.inf, t)
        return t, face

    def material(self, face: int) -> Material:
        return self.floor if face == 0 else self.ceiling if face == 1 else self.walls

    def surface(self, p: np.ndarray, face: int) -> tuple[np.ndarray, np.ndarray]:
        """Normal (N, 3) and curvatures (N, 2) at points p (N, 3) on room face ``face``, creases rounded."""
        n = np.broadcast_to(_FACE_NORMALS[face], p.shape).copy()
        k = np.zeros((len(p), 2))
        if self.bevel > 0:
            for b in range(3):
                if b == _FACE_AXIS[face]:
                    continue
                toward = np.zeros_like(p)
                toward[:, b] = 1.0  # the neighbouring face at coordinate 0 faces +b (into the room)
                _round_edges(n, k, p[:, b], toward, self.bevel, -1.0)
                _round_edges(n, k, self.size[b] - p[:, b], -toward, self.bevel, -1.0)
            n /= np.linalg.norm(n, axis=1, keepdims=True)
        return n, k


def _wall_uv(p: np.ndarray, face: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Surface coordinates on the room's faces: floor/ceiling (x, z), x-walls (z, y), z-walls (x, y)."""
    u = np.where(face < 2, p[:, 0], np.where(face < 4, p[:, 2], p[:, 0]))
    v = np.where(face < 2, p[:, 2], p[:, 1])
    return u, v


@dataclass(frozen=True)
class Scene:
    """One room, the shapes inside it, one point light, and the scan roughness of all its surfaces.

    ``roughness`` is the standard deviation (1/m) of the curvature noise added to every surface and ``clutter`` the
    scale (1/m) of its sparse spikes (module docstring); ``noise_seed`` fixes that noise and the materials' grain.
    """

    room: Room
    shapes: tuple[Shape, ...]
    light: tuple[float, float, float]
    ambient: float = 0.3
    light_power: float = 1.0
    roughness: float = 0.0
    clutter: float = 0.0
    noise_seed: int = 0


@dataclass(frozen=True)
class Camera:
    """A pinhole camera at ``position`` looking at ``target`` (no roll), horizontal = vertical field of view."""

    position: tuple[float, float, float]
    target: tuple[float, float, float]
    fov_deg: float = 60.0

    def basis(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Unit (right, up, forward) vectors in world coordinates."""
        f = np.asarray(self.target, np.float64) - np.asarray(self.position, np.float64)
        if np.linalg.norm(f) < 1e-9:
            raise ValueError("Camera.target must differ from Camera.position")
        f /= np.linalg.norm(f)
        r = np.cross(f, [0.0, 1.0, 0.0])
        if np.linalg.norm(r) < 1e-6:
            raise ValueError("Camera looks straight up or down; roll is undefined")
        r /= np.linalg.norm(r)
        return r, np.cross(r, f), f

    def focal(self, image_size: int) -> float:
        """Focal length in pixels."""
        return image_size / 2 / np.tan(np.radians(self.fov_deg) / 2)

    def rays(self, image_size: int) -> np.ndarray:
        """Unit ray directions in world coordinates, (S*S, 3) in raster order."""
        r, u, f = self.basis()
        c = (np.arange(image_size) + 0.5 - image_size / 2) / self.focal(image_size)
        xc, yc = np.meshgrid(c, -c)  # (S, S): x to the right, y up
        d = xc.reshape(-1, 1) * r + yc.reshape(-1, 1) * u + f
        return d / np.linalg.norm(d, axis=1, keepdims=True)


@dataclass
class View:
    """Everything the ray caster knows about one image, before any file encoding. Shapes are (S, S[, C]).

    Attributes:
        rgb: shaded colour in [0, 1], (S, S, 3).
        distance, zdepth: metres, inf where no geometry.
        normal: unit normals in the camera frame (x right, y down, z into the scene), zeros where no geometry.
        curvature: principal curvatures (k1, k2) in 1/m with ``|k1| >= |k2|``, convex > 0, (S, S, 2).
        shading: Taskonomy's reshading before exposure: Lambert under a point lamp at the camera, falloff
            ``D / (D + r^2)`` with ``D = LAMP_HALF_LIFE``, grey, no texture and no shadows, in [0, 1]; 0 where no
            geometry.
        surface: -1 no geometry, 0..5 room faces (ROOM_FACES), 6 + k shape k.
        category: object category of the shape hit, -1 for room surfaces and no geometry.
    """

    rgb: np.ndarray
    distance: np.ndarray
    zdepth: np.ndarray
    normal: np.ndarray
    curvature: np.ndarray
    shading: np.ndarray
    surface: np.ndarray
    category: np.ndarray

    @property
    def valid(self) -> np.ndarray:
        return self.surface >= 0


def cast(scene: Scene, o: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest hit of rays (o, d) (N, 3): distance (N,) and surface id (N,) as in View.surface."""
    t, sid = scene.room.intersect(o, d)
    sid = np.where(np.isfinite(t), sid, -1)
    for k, shape in enumerate(scene.shapes):
        ts = shape.intersect(o, d)
        closer = ts < t
        t, sid = np.where(closer, ts, t), np.where(closer, NUM_ROOM_FACES + k, sid)
    return t, sid


def _shadowed(scene: Scene, p: np.ndarray, to_light: np.ndarray, dist: np.ndarray) -> np.ndarray:
    """True where a shape blocks the segment from p toward the light (the light is inside the room)."""
    blocked = np.zeros(len(p), bool)
    for shape in scene.shapes:
        blocked |= shape.intersect(p, to_light) < dist
    return blocked


def _sky(d: np.ndarray) -> np.ndarray:
    """Colour seen through an opening: a vertical gradient, (N, 3)."""
    a = np.clip(0.5 + 0.5 * d[:, 1:2], 0, 1)
    return (1 - a) * np.array([0.78, 0.86, 0.95]) + a * np.array([0.40, 0.60, 0.92])


def render_view(scene: Scene, camera: Camera, image_size: int) -> View:
    """Ray-cast one image of ``scene`` from ``camera`` at ``image_size`` x ``image_size`` pixels."""
    if image_size < 2:
        raise ValueError(f"image_size must be >= 2, got {image_size}")
    s = image_size
    d = camera.rays(s)  # (S*S, 3)
    o = np.broadcast_to(np.asarray(camera.position, np.float64), d.shape)
    t, sid = cast(scene, o, d)
    hit = sid >= 0
    p = o + np.where(hit, t, 0.0)[:, None] * d

    n = np.zeros_like(d)
    k = np.zeros((len(d), 2))
    albedo = np.zeros_like(d)
    grain = np.zeros(len(d))
    uv = np.zeros((len(d), 2))
    category = np.full(len(d), -1)
    for face in range(NUM_ROOM_FACES):
        m = sid == face
        if m.any():
            n[m], k[m] = scene.room.surface(p[m], face)
            u, v = _wall_uv(p[m], np.full(m.sum(), face))
            mat = scene.room.material(face)
            albedo[m], grain[m], uv[m] = mat.albedo(u, v), mat.grain, np.stack([u, v], 1)
    for j, shape in enumerate(scene.shapes):
        m = sid == NUM_ROOM_FACES + j
        if m.any():
            n[m], k[m], u, v = shape.surface(p[m])
            albedo[m], grain[m], uv[m] = shape.material.albedo(u, v), shape.material.grain, np.stack([u, v], 1)
            uv[m] += 17.0 * (j + 1)  # a different stretch of grain on every shape
            category[m] = shape.category
    if grain.any():
        albedo *= 1.0 + grain[:, None] * value_noise(uv, 0.03, scene.noise_seed)
    # a surface seen from behind (never in closed shapes, kept for safety) shows its front to the camera
    n = np.where((np.einsum("ij,ij->i", n, d) > 0)[:, None], -n, n)
    if scene.roughness > 0 or scene.clutter > 0:
        z = value_noise(p[hit], 0.12, scene.noise_seed + 1, channels=4) / NOISE_STD  # about unit variance
        spikes = np.sign(z[:, 2:]) * np.maximum(np.abs(z[:, 2:]) - 1.5, 0.0)
        k[hit] += scene.roughness * z[:, :2] + scene.clutter * spikes

    to_light = np.asarray(scene.light) - p
    dist_light = np.linalg.norm(to_light, axis=1)
    to_light /= np.maximum(dist_light, 1e-9)[:, None]
    lambert = np.clip(np.einsum("ij,ij->i", n, to_light), 0.0, 1.0)
    lit = np.zeros(len(d), bool)
    lit[hit] = ~_shadowed(scene, p[hit] + 1e-4 * n[hit], to_light[hit], dist_light[hit])
    falloff = scene.light_power / (1.0 + (dist_light / 6.0) ** 2)
    light = scene.ambient + (1 - scene.ambient) * lambert * lit * falloff
    rgb = np.where(hit[:, None], albedo * light[:, None], _sky(d))
    distance = np.where(hit, t, np.inf)
    facing = np.clip(-np.einsum("ij,ij->i", n, d), 0.0, 1.0)  # the reshading lamp sits at the camera
    shading = np.where(hit, facing * LAMP_HALF_LIFE / (LAMP_HALF_LIFE + np.where(hit, t, 0.0) ** 2), 0.0)

    r, up, f = camera.basis()
    n_cam = np.stack([n @ r, -(n @ up), n @ f], axis=1)  # camera frame: x right, y down, z into the scene
    zdepth = np.where(hit, t * (d @ f), np.inf)
    order = np.abs(k[:, 1]) > np.abs(k[:, 0])
    k = np.where(order[:, None], k[:, ::-1], k)  # |k1| >= |k2|
    return View(
        rgb=np.clip(rgb, 0, 1).reshape(s, s, 3),
        distance=distance.reshape(s, s),
        zdepth=zdepth.reshape(s, s),
        normal=np.where(hit[:, None], n_cam, 0.0).reshape(s, s, 3),
        curvature=np.where(hit[:, None], k, 0.0).reshape(s, s, 2),
        shading=shading.reshape(s, s),
        surface=sid.reshape(s, s),
        category=category.reshape(s, s),
    )
