"""``district`` slots: a curated list of big-city districts (with pinyin) and a generic ``XX区`` / ``XX县`` rule
that rejects common nouns; the rules are :mod:`miaohui.nlp.slots`'s docstring."""

from __future__ import annotations

import re

from miaohui.nlp.slots_base import Candidate, parse_table

_CURATED_DISTRICTS = """
东城区 西城区 朝阳区 海淀区 丰台区 石景山区 门头沟区 房山区 通州区 顺义区 昌平区 大兴区 怀柔区 平谷区 密云区
延庆区 黄浦区 徐汇区 长宁区 静安区 普陀区 虹口区 杨浦区 闵行区 宝山区 嘉定区 浦东新区 金山区 松江区 青浦区
奉贤区 崇明区 越秀区 海珠区 荔湾区 天河区 白云区 黄埔区 番禺区 花都区 南沙区 从化区 增城区 福田区 罗湖区
南山区 盐田区 宝安区 龙岗区 龙华区 坪山区 光明区 大鹏新区 和平区 河东区 河西区 南开区 河北区 红桥区 东丽区
西青区 津南区 北辰区 武清区 宝坻区 滨海新区 宁河区 静海区 蓟州区 渝中区 江北区 沙坪坝区 九龙坡区 南岸区
渝北区 巴南区 北碚区 大渡口区 两江新区 万州区 涪陵区 上城区 拱墅区 西湖区 滨江区 萧山区 余杭区 临平区 钱塘区
富阳区 临安区 玄武区 秦淮区 建邺区 鼓楼区 浦口区 栖霞区 雨花台区 江宁区 六合区 溧水区 高淳区 江岸区 江汉区
硚口区 汉阳区 武昌区 青山区 洪山区 东西湖区 蔡甸区 江夏区 黄陂区 新洲区 锦江区 青羊区 金牛区 武侯区 成华区
龙泉驿区 青白江区 新都区 温江区 双流区 郫都区 天府新区 新城区 碑林区 莲湖区 雁塔区 未央区 灞桥区 长安区
临潼区 姑苏区 吴中区 相城区 虎丘区 吴江区 金水区 二七区 中原区 管城回族区 惠济区 郑东新区 芙蓉区 天心区
岳麓区 开福区 雨花区 历下区 市中区 槐荫区 天桥区 历城区 市南区 市北区 李沧区 崂山区 黄岛区 城阳区 沈河区
铁西区 皇姑区 大东区 浑南区 于洪区 中山区 西岗区 沙河口区 甘井子区 道里区 南岗区 道外区 香坊区 蜀山区
包河区 庐阳区 瑶海区 思明区 湖里区 集美区 海沧区 同安区 翔安区 五华区 盘龙区 官渡区 西山区 青秀区 兴宁区
长安区 桥西区 裕华区 小店区 迎泽区 杏花岭区 东湖区 青云谱区 南明区 云岩区 城关区 七里河区 高新区 经开区
"""
_DISTRICTS = frozenset(_CURATED_DISTRICTS.split())
#: Names also recognised without the suffix; the value is the full name.
_BARE_DISTRICT_NAMES = """
海淀区 丰台区 石景山区 门头沟区 昌平区 顺义区 怀柔区 密云区 延庆区 徐汇区 闵行区 浦东新区 静安区 杨浦区 虹口区
嘉定区 奉贤区 崇明区 番禺区 荔湾区 越秀区 海珠区 福田区 罗湖区 宝安区 龙岗区 萧山区 余杭区 拱墅区 武侯区
雁塔区 碑林区 江宁区 渝中区 渝北区 沙坪坝区 九龙坡区 硚口区 洪山区 历下区 崂山区 青羊区
"""
_BARE_DISTRICTS = {name.removesuffix("区").removesuffix("新"): name for name in _BARE_DISTRICT_NAMES.split()}
_PINYIN_TABLE = """
东城区: dongcheng
西城区: xicheng
朝阳区: chaoyang
海淀区: haidian
丰台区: fengtai
石景山区: shijingshan
通州区: tongzhou
顺义区: shunyi
昌平区: changping
大兴区: daxing
徐汇区: xuhui
长宁区: changning
静安区: jing'an|jingan
普陀区: putuo
虹口区: hongkou
杨浦区: yangpu
闵行区: minhang
宝山区: baoshan
嘉定区: jiading
浦东新区: pudong
松江区: songjiang
青浦区: qingpu
天河区: tianhe
越秀区: yuexiu
海珠区: haizhu
荔湾区: liwan
番禺区: panyu
福田区: futian
罗湖区: luohu
南山区: nanshan
宝安区: bao'an|baoan
龙岗区: longgang
西湖区: xihu
滨江区: binjiang
萧山区: xiaoshan
余杭区: yuhang
武侯区: wuhou
锦江区: jinjiang
雁塔区: yanta
江宁区: jiangning
渝中区: yuzhong
武昌区: wuchang
洪山区: hongshan
"""
_PINYIN_DISTRICTS = parse_table(_PINYIN_TABLE)
_BARE_GUARD = "新?区|机场|路|大道|大街|城|公园|站|桥|镇|村|湖|山|江|河|广场|中学|小学|医院|大学|图书馆|体育|街道"
_CURATED_RE = re.compile(
    "|".join(sorted(_DISTRICTS, key=len, reverse=True))
    + "|"
    + "|".join(f"{b}(?!{_BARE_GUARD})" for b in sorted(_BARE_DISTRICTS, key=len, reverse=True))
)
_PINYIN_RE = re.compile(r"\b(?P<name>[A-Z][a-z']+)\s+(?:District|New\s+Area|County)\b")
#: Characters that cannot be part of a district name caught by the generic rule.
_DISTRICT_STOP_CHARS = frozenset(
    "的在我你他她它是了个哪这那本该全各每们到去从住问请和与跟里几些么啥吗呢吧啊就也都还要想给对向往于为被把让有"
    "没不很太最更市省边内外上下前后中等及或又再已曾将会能可第其此某何谁自己附近整所靠个一二三四五六七八九十两零"
)
#: A generic ``X区`` whose character before 区 is one of these is a common noun (社区, 小区, 开发区 ...).
_DISTRICT_NOUN_ENDINGS = frozenset(
    "社小地景园市城郊山灾校厂街禁误雷盲片辖营库矿牧林分专赛展战特选商学发税范务业宅活公验贸能游护心车候烟童居"
    "病考港点政域物食闲动息览售停餐座站馆楼层"
)
_COUNTY_NOUN_ENDINGS = frozenset("郊邻外困强本该全各小")
_DISTRICT_SUFFIX_RE = re.compile(r"(?<=[\u4e00-\u9fff])[区县](?![长委域别分间块号划位级官令])")


def _generic_district(folded: str, k: int) -> tuple[int, str] | None:
    """``XX区`` / ``XX县`` / ``XX新区`` ending at index ``k`` (the suffix); returns (start, name)."""
    suffix = folded[k]
    if suffix == "区" and k >= 3 and folded[k - 1] == "新":
        core = folded[k - 3 : k - 1]
        if _valid_core(core, "区"):
            return k - 3, core + "新区"
    core = folded[max(0, k - 2) : k]
    if len(core) == 2 and _valid_core(core, suffix):
        return k - 2, core + suffix
    return None


def _valid_core(core: str, suffix: str) -> bool:
    """True if ``core`` may be a district/county name (two CJK characters, not a common noun)."""
    if len(core) != 2 or not all("\u4e00" <= c <= "\u9fff" for c in core):
        return False
    if any(c in _DISTRICT_STOP_CHARS for c in core):
        return False
    endings = _DISTRICT_NOUN_ENDINGS if suffix == "区" else _COUNTY_NOUN_ENDINGS
    return core[-1] not in endings


def districts(folded: str) -> list[Candidate]:
    """District / county names."""
    found: list[Candidate] = []
    for m in _CURATED_RE.finditer(folded):
        name = m.group()
        found.append(Candidate("district", m.start(), m.end(), name if name in _DISTRICTS else _BARE_DISTRICTS[name]))
    for m in _PINYIN_RE.finditer(folded):
        pinyin = _PINYIN_DISTRICTS.get(m["name"].lower())
        found.append(Candidate("district", m.start(), m.end(), pinyin or m.group()))
    for m in _DISTRICT_SUFFIX_RE.finditer(folded):
        k = m.start()
        if any(c.start <= k < c.end for c in found):
            continue
        hit = _generic_district(folded, k)
        if hit is not None:
            found.append(Candidate("district", hit[0], k + 1, hit[1]))
    return found
